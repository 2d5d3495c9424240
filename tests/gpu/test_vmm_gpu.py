"""VMM pool over the CUDA driver: two ranges alias one set of physical chunks."""

from __future__ import annotations

import pytest
import torch

from raygraph.memory.vmm import CudaBackend, VmmError, VmmPool

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_cuda_spaces_alias_and_release_frees() -> None:
    backend = CudaBackend(0)
    chunk = backend.granularity() * max(1, (64 * MiB) // backend.granularity())
    pool = VmmPool(backend, chunk, 8 * chunk)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()

    pool.new_space()
    a = pool.alloc(3 * chunk)
    pool.new_space()
    b = pool.alloc(2 * chunk)
    ta = pool.tensor(a, 3 * chunk)
    tb = pool.tensor(b, 2 * chunk)
    assert ta.is_cuda and ta.data_ptr() == a and tb.data_ptr() == b

    for i in range(3):  # a different byte in each chunk, so a mis-mapped chunk shows
        ta[i * chunk : (i + 1) * chunk] = 10 + i
    torch.cuda.synchronize()
    for i in range(2):
        assert torch.all(tb[i * chunk : (i + 1) * chunk] == 10 + i)
    tb[chunk + 5] = 77
    torch.cuda.synchronize()
    assert int(ta[chunk + 5]) == 77

    s = pool.stats()
    assert (s.chunks, s.physical_bytes, s.virtual_bytes) == (3, 3 * chunk, 16 * chunk)
    assert s.space_peak_bytes == [3 * chunk, 2 * chunk]
    free_mapped, _ = torch.cuda.mem_get_info()
    assert free_before - free_mapped >= 3 * chunk

    del ta, tb
    pool.release()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after - free_mapped >= 3 * chunk
    with pytest.raises(VmmError, match="after release"):
        pool.alloc(1)


# --- the VMM pool under the graph executor: a MemPool and a virtual range per capture ---

import random  # noqa: E402
import time  # noqa: E402

from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig  # noqa: E402
from raygraph.graph.executor import EagerExecutor  # noqa: E402
from raygraph.graph.runners import FullGraph  # noqa: E402
from raygraph.protocol import BucketKey, SeqChunk, StepPlan  # noqa: E402
from raygraph.worker import sizing  # noqa: E402
from raygraph.worker.worker import Worker  # noqa: E402
from tests.conftest import randomise_caches  # noqa: E402

BS = 16


@pytest.fixture(scope="module")
def ckpt(gpu_llama):
    return gpu_llama


def vmm_worker(ckpt, pool: str = "vmm") -> Worker:
    cfg = ServeConfig(
        model=str(ckpt), device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=BS, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128),
        graph=GraphConfig(pool=pool),
    )
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    return w


def captured_worker(ckpt) -> Worker:
    """A VMM-pool worker with the whole schedule captured over random KV contents."""
    w = vmm_worker(ckpt)
    w.allocate_kv_cache(256)
    w.capture_all()
    randomise_caches([w], 0)
    return w


def plan_for(key: BucketKey, rng: random.Random) -> StepPlan:
    """A batch that lands exactly in `key`, over random contexts in disjoint blocks."""
    n = key.num_tokens
    if key.phase == "decode":
        lens = [1] * n
    else:  # every sequence takes >= 2 tokens, else the step would be a decode step
        lens = [n] if n < 8 else [n // 2, n - n // 2]
    seqs, block = [], 0
    for i, q in enumerate(lens):
        ctx = rng.randrange(0, 90)
        nb = -(-(ctx + q) // BS)
        seqs.append(SeqChunk(i, [rng.randrange(3, 512) for _ in range(q)], ctx,
                             list(range(block, block + nb)), True))
        block += nb
    return StepPlan(0, seqs)


def check_all_keys(w: Worker, rng: random.Random) -> None:
    """Every captured graph, in random order, against eager on the same inputs."""
    eager = EagerExecutor(w.model, BS)
    # a 1-token prefill bucket is never chosen: a 1-token step is a decode step
    keys = [k for k in w.executor.graphs if k != BucketKey("prefill", 1)]
    rng.shuffle(keys)
    for key in keys:
        plan = plan_for(key, rng)
        got = w.executor.logits(plan)
        assert w.executor.last_key == key
        torch.testing.assert_close(got, eager.logits(plan), atol=3e-2, rtol=3e-2,
                                   msg=lambda m, k=key: f"{k}: {m}")


def test_every_vmm_graph_replays_right_after_all_were_captured(ckpt) -> None:
    w = captured_worker(ckpt)
    ex = w.executor
    s = ex.pool_stats()
    assert s.kind == "vmm" and s.spaces == len(ex.graphs) == len(ex.schedule())
    peaks = list(s.capture_bytes.values())
    assert s.held_bytes == -(-max(peaks) // s.chunk_size) * s.chunk_size < sum(peaks)
    # one range per capture: each decode graph's output lies in a range of its own
    bases = sorted({r.out[0].data_ptr() // ex.pool.vmm.range_size for r in ex.graphs.values()
                    if isinstance(r, FullGraph)})
    assert len(bases) == sum(isinstance(r, FullGraph) for r in ex.graphs.values())
    rng = random.Random(0)
    for _ in range(2):
        check_all_keys(w, rng)
    w.shutdown()
    assert ex.pool.vmm.live_allocations == 0  # torch gave every segment back


def test_sleep_releases_graph_memory_and_wake_replays_without_recapture(ckpt) -> None:
    w = captured_worker(ckpt)
    ex = w.executor
    graphs = dict(ex.graphs)
    held = ex.pool.held_bytes()
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    w.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake >= held > 0
    assert w.memory_stats().graph.asleep and ex.pool.held_bytes() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        ex.logits(plan_for(BucketKey("decode", 4), random.Random(1)))
    t0 = time.perf_counter()
    w.wake_up()
    wake_s = time.perf_counter() - t0
    free_woken, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_woken >= held and ex.pool.held_bytes() == held
    assert wake_s < 1.0
    assert all(ex.graphs[k] is r for k, r in graphs.items())  # no recapture
    del graphs  # graphs must not outlive the pool's release
    check_all_keys(w, random.Random(2))
    w.shutdown()
    assert ex.pool.vmm.live_allocations == 0  # torch gave every segment back


def test_graph_budget_is_measured_enforced_and_loud(ckpt) -> None:
    from raygraph.memory.vmm import VmmError

    w = vmm_worker(ckpt)
    graph_bytes = sizing.graph_bytes(w)  # what load() subtracts when it sizes the cache
    budget = w.graph_budget
    assert budget > 0 and graph_bytes == budget + w._make_executor(None).input_buffer_bytes
    w.allocate_kv_cache(256)
    w.capture_all()
    s = w.memory_stats().graph
    assert budget >= w.graph_measured * 1.25 >= budget - s.chunk_size  # the headroom
    assert s.budget_bytes == budget and w.graph_measured <= s.held_bytes <= budget
    w.shutdown()
    assert w.executor.pool.vmm.live_allocations == 0

    small = vmm_worker(ckpt)
    small.graph_budget = w.graph_measured - s.chunk_size  # one chunk short of the largest
    small.allocate_kv_cache(256)
    errors = []
    for key in (BucketKey("decode", 32), BucketKey("prefill", 128)):  # the largest keys
        try:
            small.executor.capture(key)
        except VmmError as e:
            errors.append(str(e))
    assert errors and f"graph budget is {small.graph_budget} bytes" in errors[0]
    small.executor.release()  # the process is still usable: capture anew, no budget
    small.executor = small._make_executor(None)
    small.executor.capture_all()
    randomise_caches([small], 0)
    check_all_keys(small, random.Random(3))
    small.shutdown()
