"""Attention DP + MoE EP through the coordinator (Ray actors, gloo): greedy tokens equal HF
on tiny Mixtral / Qwen2-MoE checkpoints with unbalanced loads, and the bucket key carries
the dispatch size."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from raygraph.api.metrics import Metrics
from raygraph.client.connect import start_coordinator
from raygraph.config import (
    CacheConfig,
    ConfigError,
    GraphConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.graph.buckets import BucketPlan
from raygraph.protocol import BucketKey, SamplingParams, SeqChunk, StepPlan
from raygraph.worker.worker import Worker
from tests.conftest import make_checkpoint, stop_coordinators
from tests.hf_ref import hf_greedy

ARCHS = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
}
GRAPH = GraphConfig(decode_sizes=[1, 2, 4], prefill_sizes=[8, 16, 32], capture="at_start")
# uneven: 5 requests over 2 DP groups, lengths and output counts differ so that one group
# idles while the other still prefills or decodes
PROMPTS = [[5, 9, 33, 100, 7], [17, 3, 250, 8, 64, 99, 12, 41, 77, 6, 15, 200, 31, 9, 4, 8, 2],
           [42, 7, 19], [11], [8, 13, 21, 34, 55, 89]]
MAX_TOKENS = [7, 2, 5, 1, 3]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), arch, **kw)
            for name, (arch, kw) in ARCHS.items()}


def config(model, name: str, tp: int, dp: int, ep: int, blocks: int = 64) -> ServeConfig:
    """`blocks`: each DP group's pool of 4-token blocks."""
    return ServeConfig(
        model=str(model), device="cpu", parallel=ParallelConfig(tp=tp, dp=dp, ep=ep),
        graph=GRAPH, cache=CacheConfig(block_size=4, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64),
        coordinator_name=name, step_timeout_s=60,
    )


# Mixtral's layouts that both the layout test and the prefix-caching test serve, with pools
# small enough for the prefix test's waves to preempt: one coordinator each serves both
SHARED_LAYOUTS = [(2, 1, 1), (1, 2, 2)]
SHARED_BLOCKS = 8


@pytest.fixture(scope="module")
def mixtral(ray_session) -> dict[tuple[int, int, int], Any]:
    """Layout -> Mixtral's coordinator (mixtral_coordinator): the prefix test stops each one
    it is done with, the module's end any left."""
    coords: dict[tuple[int, int, int], Any] = {}
    yield coords
    stop_coordinators(list(coords.values()))


def mixtral_coordinator(coords: dict, ckpts: dict, layout: tuple[int, int, int]) -> Any:
    """The shared coordinator of a layout in SHARED_LAYOUTS, started on first use."""
    if layout not in coords:
        name = "moe-mixtral-" + "".join(map(str, layout))
        coords[layout] = start_coordinator(config(ckpts["mixtral"], name, *layout,
                                                  blocks=SHARED_BLOCKS))
    return coords[layout]


# the shared layouts last, so that no more than two coordinators run at once
@pytest.mark.parametrize("arch,tp,dp,ep", [
    ("qwen2_moe", 1, 2, 2), pytest.param("qwen2_moe", 2, 1, 2, marks=pytest.mark.slow),
    ("mixtral", 1, 2, 2), ("mixtral", 2, 1, 1)])
def test_moe_layouts_generate_hf_greedy_tokens(ray_session, ckpts, mixtral, arch, tp, dp, ep):
    shared = arch == "mixtral"
    coord = (mixtral_coordinator(mixtral, ckpts, (tp, dp, ep)) if shared else
             start_coordinator(config(ckpts[arch], f"moe-{arch}-{tp}{dp}{ep}", tp, dp, ep)))
    try:
        refs = [coord.generate.remote(p, SamplingParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(PROMPTS, MAX_TOKENS)]
        got = [ray_session.get(r)[0].token_ids for r in refs]
        want = hf_greedy(ckpts[arch], PROMPTS, max(MAX_TOKENS))
        assert got == [w[:n] for w, n in zip(want, MAX_TOKENS)]
        reports = ray_session.get(coord.capture_report.remote())
        assert reports and all(r.agree for r in reports)
        if dp > 1:
            # unbalanced steps needed keys whose dispatch size exceeds the local bucket;
            # they were captured in lockstep on every rank when first seen
            assert any(r.key.num_comm_tokens > r.key.num_tokens for r in reports)
            assert ray_session.get(coord.describe.remote())["dp"] == 2
    finally:
        if not shared:
            stop_coordinators([coord])


# prefix caching: a shared 10-token head (two full 4-token blocks and two more), prompts that
# are prefixes of others, one repeated whole (its last block is computed again)
HEAD = [17, 3, 250, 8, 64, 99, 12, 41, 77, 6]
SHARED = [HEAD + [5, 9], HEAD + [30, 31, 32], HEAD, HEAD[:8] + [1, 2], HEAD + [5, 9],
          HEAD + [5, 9, 11, 13, 40], HEAD[:4] + [100], HEAD + [30, 31]]


@pytest.mark.parametrize("tp,dp,ep", SHARED_LAYOUTS)
def test_prefix_caching_with_preemption_generates_hf_greedy_tokens(ray_session, ckpts, mixtral,
                                                                   tp, dp, ep):
    """TP=2 and DP2 x EP2, each group's pool of 8 blocks: sequences hit the blocks of those
    running and of those finished (the second wave), are preempted and recompute from what
    is still cached; the greedy tokens are HF's. The coordinator may have served the layout
    test: the counts are this test's own."""
    coord = mixtral_coordinator(mixtral, ckpts, (tp, dp, ep))
    try:
        before = ray_session.get(coord.stats.remote())
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        got = []
        for wave in (SHARED[:5], SHARED[5:]):
            got += [r.token_ids for r in ray_session.get(coord.generate.remote(wave, params))]
        stats = ray_session.get(coord.stats.remote())
    finally:
        stop_coordinators([mixtral.pop((tp, dp, ep))])
    assert got == hf_greedy(ckpts["mixtral"], SHARED, 6)
    kv, hits_before = stats["kv_cache"], before["kv_cache"]["prefix_cache_hits"]
    assert stats["preemptions"] > before["preemptions"]
    assert kv["prefix_cache_hits"] - hits_before >= 8 * 3
    assert kv["num_pages"] == SHARED_BLOCKS * dp and kv["pages"]["pinned"] == 0
    text = Metrics("m").render(stats).decode()  # the coordinator's figures, as /metrics
    assert (f'raygraph:prefix_cache_hits_total{{model_name="m",replica="0"}} '
            f'{kv["prefix_cache_hits"]}.0') in text.splitlines()
    assert 'raygraph:pool_pages{kind="kv",model_name="m",replica="0",state="pinned"} 0.0' \
        in text


def wait_captured(ray, coord, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while not (p := ray.get(coord.capture_progress.remote()))["done"]:
        assert time.monotonic() < deadline, p
        time.sleep(0.05)
    return p


def test_background_capture_runs_new_dispatch_sizes_eagerly_then_replays(ray_session, ckpts):
    """Background capture (the default) at DP2 x EP2: a key first seen in traffic (an
    unbalanced dispatch size, outside the schedule) runs eagerly on every rank, is captured
    between steps, and the greedy tokens are HF's across the switch. A capture failure in
    the background fails the requests in flight with the key and rank named."""
    cfg = config(ckpts["mixtral"], "bg-dpep", 1, 2, 2)
    cfg = msgspec.structs.replace(cfg, graph=msgspec.structs.replace(GRAPH, capture="background"))
    coord = start_coordinator(cfg)
    try:
        schedule = wait_captured(ray_session, coord)["total"]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        got = [r.token_ids for r in ray_session.get(coord.generate.remote(PROMPTS[:3], params))]
        assert got == hf_greedy(ckpts["mixtral"], PROMPTS[:3], 6)
        p = wait_captured(ray_session, coord)
        assert p["eager_steps"] > 0 and p["total"] > schedule  # the new keys, then captured
        keys = [r.key for r in ray_session.get(coord.capture_report.remote())]
        assert any(k.num_comm_tokens > k.num_tokens for k in keys)
        again = [r.token_ids for r in ray_session.get(coord.generate.remote(PROMPTS[:3],
                                                                            params))]
        assert again == got
        wait_captured(ray_session, coord)
        # five prompts: new unbalanced keys again, whose capture fails on rank 1
        ray_session.get(coord.inject_fault.remote(1, "raise", "capture"))
        with pytest.raises(Exception, match=r"capture of .*rank.*1"):
            ray_session.get(coord.generate.remote(PROMPTS, params), timeout=120)
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)


def test_same_local_size_different_dispatch_size_selects_different_graphs():
    plan = BucketPlan.from_config(GRAPH, 4, 16, ep=True)
    balanced = plan.key(3, 3, True, plan.comm_tokens([(3, 3, True), (4, 4, True)]))
    skewed = plan.key(3, 3, True, plan.comm_tokens([(3, 3, True), (12, 2, False)]))
    assert balanced == BucketKey("decode", 4, 4)
    assert skewed == BucketKey("decode", 4, 16)
    assert plan.allows(balanced) and plan.allows(skewed)
    assert not plan.allows(BucketKey("decode", 4, 2))  # dispatch below the local batch
    # above the largest capture size every rank runs eagerly, with the real dispatch size
    assert plan.key(3, 3, True, 40) == BucketKey("eager", 3, 40)
    assert BucketPlan.from_config(GRAPH, 4, 16).key(3, 3, True) == BucketKey("decode", 4)


def test_a_plan_for_the_wrong_dispatch_size_is_refused(ckpts):
    cfg = config(ckpts["mixtral"], "x", 1, 1, 1)
    cfg = msgspec.structs.replace(cfg, graph=msgspec.structs.replace(GRAPH, capture="at_start"))
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(16)
    seqs = [SeqChunk(i, [5 + i], 2, [i], True) for i in range(3)]
    # the coordinator chose the graph for dispatch size 16 but sent dispatch size 4
    with pytest.raises(Exception, match=r"rank 0: step 3: the coordinator chose .*16.* gives"):
        w.execute(StepPlan(3, seqs, key=BucketKey("decode", 4, 16), num_comm_tokens=4))


@pytest.mark.parametrize("tp,dp,ep,match", [(1, 2, 1, "needs ep"), (2, 2, 2, "must be 1 or"),
                                            (1, 1, 3, "must be 1 or")])
def test_impossible_layouts_are_refused(tp, dp, ep, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(tp=tp, dp=dp, ep=ep)
