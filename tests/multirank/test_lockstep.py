"""Lockstep capture across TP ranks on CPU: real Ray actors, gloo, the coordinator's
protocol (barrier, capture, record comparison) and its failure modes."""

from __future__ import annotations

import time

import msgspec
import pytest

from raygraph.client.connect import start_coordinator
from raygraph.config import (
    CacheConfig,
    GraphConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.engine.lockstep import (
    CaptureError,
    LockstepCapture,
    first_difference,
    remote_call_all,
)
from raygraph.graph.buckets import BucketPlan
from raygraph.protocol import (
    BucketKey,
    CaptureRecord,
    Collective,
    SamplingParams,
    SeqChunk,
    StepPlan,
)
from raygraph.worker.worker import Worker
from tests.hf_ref import hf_greedy

SIZES = GraphConfig(decode_sizes=[1, 2, 4], prefill_sizes=[8, 16, 32], capture_timeout_s=20)


def config(model, name: str, graph: GraphConfig = SIZES, **kw) -> ServeConfig:
    return ServeConfig(
        model=str(model), device="cpu", parallel=ParallelConfig(tp=2), graph=graph,
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        coordinator_name=name, step_timeout_s=30, **kw,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def start_group(ray, cfgs: list[ServeConfig]) -> list:
    """Two workers built by hand, so each rank may be given its own config."""
    actor = ray.remote(Worker).options(num_cpus=1)
    workers = [actor.remote(cfg, rank) for rank, cfg in enumerate(cfgs)]
    addr = ray.get(workers[0].address.remote())
    ray.get([w.load.remote(addr) for w in workers])
    ray.get([w.allocate_kv_cache.remote(16) for w in workers])
    return workers


def stop(ray, workers) -> None:
    for w in workers:
        ray.kill(w)


def capture_keys(workers, keys: list[BucketKey]) -> LockstepCapture:
    lock = LockstepCapture(len(workers))
    for key in keys:
        lock.capture(key, remote_call_all(workers, timeout=20))
    return lock


def test_tp2_schedule_is_captured_in_lockstep_and_serves(ray_session, tiny_llama):
    coord = start_coordinator(config(tiny_llama, "lockstep-ok",
                                        msgspec.structs.replace(SIZES, capture="at_start")))
    try:
        reports = ray_session.get(coord.capture_report.remote())
        keys = [r.key for r in reports]
        # largest first within each phase, every key of the schedule, all ranks agreeing
        assert keys == [BucketKey("decode", n) for n in (4, 2, 1)] + \
            [BucketKey("prefill", n) for n in (32, 16, 8)]
        assert all(r.agree and r.difference is None for r in reports)
        # two layers' attention + MLP all-reduces, the embedding's and the logits' gather
        assert all(r.collectives >= 5 for r in reports)
        stats = ray_session.get(coord.worker_stats.remote())
        assert [s["memory"]["rank"] for s in stats] == [0, 1]
        assert all(s["memory"]["kv_cache_bytes"] > 0 and s["offload"] is None for s in stats)
        prompts = [[5, 6, 7], [9] * 20]
        out = ray_session.get(coord.generate.remote(prompts, greedy(6)))
        assert [r.token_ids for r in out] == hf_greedy(tiny_llama, prompts, 6)
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)


def test_background_capture_serves_hf_tokens_before_and_after_the_schedule(ray_session,
                                                                          tiny_llama):
    """The GPU default: the coordinator serves at once while the schedule is captured
    between steps (eager steps until a key is captured on every rank); the greedy tokens are
    HF's whether a step ran eagerly or replayed, before and after the schedule completes."""
    graph = msgspec.structs.replace(SIZES, capture="background")
    coord = start_coordinator(config(tiny_llama, "lockstep-bg", graph))
    try:
        info = ray_session.get(coord.describe.remote())
        assert info["capture"] == "background" and info["keys_total"] == 6
        prompts = [[5, 6, 7], [9] * 20]
        want = hf_greedy(tiny_llama, prompts, 6)
        first = ray_session.get(coord.generate.remote(prompts, greedy(6)))
        assert [r.token_ids for r in first] == want
        deadline = time.monotonic() + 120
        while not (p := ray_session.get(coord.capture_progress.remote()))["done"]:
            assert time.monotonic() < deadline, p
            time.sleep(0.05)
        assert p["captured"] == p["total"] == 6 and p["complete_after_s"] is not None
        reports = ray_session.get(coord.capture_report.remote())
        assert len(reports) == 6 and all(r.agree for r in reports)
        again = ray_session.get(coord.generate.remote(prompts, greedy(6)))
        assert [r.token_ids for r in again] == want
        assert ray_session.get(coord.stats.remote())["keys_captured"] == 6
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)


def test_keys_first_seen_at_run_time_are_captured_on_all_ranks(ray_session, tiny_llama):
    graph = msgspec.structs.replace(SIZES, capture="lazy")
    coord = start_coordinator(config(tiny_llama, "lockstep-lazy", graph))
    try:
        assert ray_session.get(coord.capture_report.remote()) == []
        prompts = [[5, 6, 7], [11, 12]]
        out = ray_session.get(coord.generate.remote(prompts, greedy(4)))
        assert [r.token_ids for r in out] == hf_greedy(tiny_llama, prompts, 4)
        keys = {r.key for r in ray_session.get(coord.capture_report.remote())}
        # prefill of 5 tokens -> bucket 8; decode of 2 seqs -> bucket 2 (all ranks agreed)
        assert {BucketKey("prefill", 8), BucketKey("decode", 2)} <= keys
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)


def test_a_rank_with_a_different_schedule_is_refused_at_the_barrier(ray_session, tiny_llama):
    odd = msgspec.structs.replace(SIZES, decode_sizes=[1, 2, 3])
    workers = start_group(ray_session, [config(tiny_llama, "x"), config(tiny_llama, "x", odd)])
    try:
        with pytest.raises(CaptureError, match=r"prepare_capture of .*decode.*4.* rank 1"):
            (capture_keys(workers, [BucketKey("decode", 4)]))
    finally:
        stop(ray_session, workers)


def test_a_rank_with_different_buffers_disagrees_naming_key_and_ranks(ray_session, tiny_llama):
    cfg = config(tiny_llama, "x")
    longer = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(
        cfg.scheduler, max_model_len=128))  # wider block tables on rank 1 only
    workers = start_group(ray_session, [cfg, longer])
    try:
        with pytest.raises(CaptureError, match=r"decode.*buffers: rank 0 has .*rank 1 has"):
            (capture_keys(workers, [BucketKey("decode", 4)]))
    finally:
        stop(ray_session, workers)


def test_ranks_padding_to_different_graphs_fail_the_step_naming_the_rank(ray_session, tiny_llama):
    cfg = config(tiny_llama, "x")
    odd = msgspec.structs.replace(SIZES, decode_sizes=[1, 2, 3, 4])  # pads 3 seqs to 3, not 4
    workers = start_group(ray_session, [cfg, config(tiny_llama, "x", odd)])
    try:
        (capture_keys(workers, [BucketKey("decode", 4)]))
        seqs = [SeqChunk(i, [5 + i], 3, [i], True) for i in range(3)]
        key = BucketPlan.from_config(SIZES, 4, 32).key(3, 3, decode=True)
        assert key == BucketKey("decode", 4)
        plan = StepPlan(7, seqs, key=key)
        rank0 = workers[0].execute.remote(plan)  # blocks in its collective: rank 1 never joins
        with pytest.raises(Exception, match=r"rank 1: step 7: the coordinator chose .*decode.*4"
                                            r".* gives .*decode.*3"):
            ray_session.get(workers[1].execute.remote(plan), timeout=20)
        del rank0
    finally:
        stop(ray_session, workers)


@pytest.mark.parametrize("kind", ["exit", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_rank_dying_or_stalling_in_capture_is_an_error_within_the_timeout(
        ray_session, tiny_llama, kind):
    graph = msgspec.structs.replace(SIZES, capture="lazy", capture_timeout_s=5)
    coord = start_coordinator(config(tiny_llama, f"lockstep-{kind}", graph))
    try:
        workers = ray_session.get(coord.worker_handles.remote())
        ray_session.get(workers[1].inject_fault.remote(kind, "capture",
                                                       BucketKey("prefill", 16)))
        t0 = time.perf_counter()
        with pytest.raises(CaptureError, match=r"capture of .*prefill.*16.*rank.*1"):
            ray_session.get(coord.capture_schedule.remote())
        assert time.perf_counter() - t0 < 5 + 15
        assert not ray_session.get(coord.stats.remote())["healthy"]
        # the group was torn down; start-up can be retried and serves again
        ray_session.get(coord.start.remote())
        out = ray_session.get(coord.generate.remote([[5, 6]], greedy(3)))
        assert out[0].token_ids == hf_greedy(tiny_llama, [[5, 6]], 3)[0]
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)


def record(rank: int, colls: list[Collective]) -> CaptureRecord:
    return CaptureRecord(BucketKey("decode", 4), rank, 1, 100, colls, 0, [], 0.0)


def test_first_difference_names_the_collective_and_the_ranks():
    a = [Collective("all_reduce", "bfloat16", 4 * 64, 2), Collective("all_gather", "bfloat16",
                                                                     4 * 128, 2)]
    b = [a[0], Collective("all_gather", "bfloat16", 5 * 128, 2)]
    assert first_difference([record(0, a), record(1, list(a))]) is None
    diff = first_difference([record(0, a), record(1, b)])
    assert "collective #1" in diff and "rank 0" in diff and "rank 1" in diff and "640" in diff
    assert "collective #2" in first_difference([record(0, a), record(1, a + a[:1])])
