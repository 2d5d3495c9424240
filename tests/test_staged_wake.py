"""Staged wake on CPU (memfd VMM: an unmapped chunk is PROT_NONE, so a step that touched a
block past the mapped ones would crash this process): wake maps the KV cache's first blocks,
the page pool offers only those, the rest come online as a thread maps them; greedy tokens
equal those before the sleep; a sleep during the mapping and a failed mapping are safe."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import msgspec
import pytest
import torch

from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore, local_dispatch
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.engine.sleep import KV_POLL_S, SleepControl
from raygraph.graph.buckets import bucket_plan
from raygraph.memory.arena import tensor_bytes
from raygraph.memory.kv_arena import chunk_needs, kv_arena
from raygraph.memory.stats import KVMapError
from raygraph.memory.vmm import MemfdBackend, VmmError
from raygraph.protocol import SamplingParams, StepDelta
from raygraph.worker.worker import Worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")

BLOCKS, BLOCK_SIZE = 64, 4
BLOCK_BYTES = 2 * 4 * BLOCK_SIZE * 2 * 64 * 4  # K and V x 4 layers x [4, 2 heads, 64] fp32
FIRST = 8  # blocks a staged wake maps before it returns
DELTA = msgspec.msgpack.Decoder(StepDelta)


def config(staged: bool = True) -> ServeConfig:
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=BLOCKS, staged_wake=staged,
                        wake_first_bytes=FIRST * BLOCK_BYTES)
    return ServeConfig(device="cpu", cache=cache,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                 max_model_len=256),
                       graph=GraphConfig(decode_sizes=[1, 2, 4, 8], prefill_sizes=[16, 32]))


@pytest.fixture(scope="module")
def worker():
    w = Worker(config(), 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(BLOCKS)
    w.capture_all()
    assert w.kv_bytes_per_block() == BLOCK_BYTES
    return w


def slow_mapping(worker: Worker, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Each chunk the background thread maps takes delay_s longer (memfd maps in us)."""
    kv = worker.sleep_memory.kv
    real = type(kv).map_next

    def map_next() -> bool:
        time.sleep(delay_s)
        return real(kv)

    monkeypatch.setattr(kv, "map_next", map_next)


def wait_ready(worker: Worker, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.kv_blocks_ready() < BLOCKS:
        assert time.monotonic() < deadline, worker.kv_blocks_ready()
        time.sleep(0.002)


def prompts(n: int, length: int) -> list[list[int]]:
    return [[5 + i, 9, 11, 13 + i, 7, 3 + i % 5] * (length // 6) for i in range(n)]


class Served:
    """The coordinator's step loop in one process: an engine over `worker`, its pool behind
    a SleepControl that polls the worker between steps; every block a step hands out is
    checked against what the pool offers and what the worker has mapped."""

    def __init__(self, worker: Worker) -> None:
        wait_ready(worker)  # a test before may have left a staged wake mapping
        self.worker = worker
        c = worker.cfg
        self.sched = Scheduler(PagePool.from_config(BLOCKS, c.cache), 8, 32, 256, (),
                               c.cache.enable_prefix_caching)
        self.control = SleepControl(lambda: 0, self._now, self._call, offload=False,
                                    forget_kv=self.sched.kv.clear,
                                    pools=lambda: [self.sched.pool])
        self.core = EngineCore([self.sched], bucket_plan(c), ep=False)
        self._dispatch = local_dispatch(worker)
        self.handed_out: list[tuple[int, int]] = []  # (block, pages online then)
        self.online_seen: set[int] = set()

    async def _now(self, fn):
        return fn()

    def _call(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def dispatch(self, msgs: list[bytes]) -> list:
        (msg,) = msgs
        if msg:
            online, mapped = self.sched.pool.num_online, self.worker.sleep_memory.kv.blocks_ready
            for _, block in DELTA.decode(msg).blocks:
                assert block < online <= mapped, (block, online, mapped)
                self.handed_out.append((block, online))
        return self._dispatch(msgs)

    def sleep(self, level: int = 1) -> dict:
        return asyncio.run(self.control.sleep(level))

    def wake(self) -> dict:
        return asyncio.run(self.control.wake_up())

    def run(self, token_prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(token_prompts)]
        for s in seqs:
            self.sched.add(s)
        while True:
            if self.control.poll_due():
                if self.core.in_flight is not None:
                    self.core.flush(self.dispatch)
                self.control.poll_kv()
            self.online_seen.add(self.sched.pool.num_online)
            if self.core.step(self.dispatch) is None:
                break
        self.sched.pool.check_invariants()
        return [s.output_token_ids for s in seqs]


def test_chunk_needs_put_scratch_blocks_first_then_block_order():
    # two tensors of 7 rows of 10 bytes, back to back, in chunks of 16 bytes: chunk 4
    # ([64, 80)) holds row 6 of the first (its scratch block) and row 0 of the second
    needs = chunk_needs([(0, 7, 10), (70, 7, 10)], 16, 9)
    assert needs == [0, 1, 3, -1, -1, 1, 2, 4, -1]


def test_kv_arena_first_slice_then_the_rest_in_block_order():
    shape, layers = (BLOCKS + 1, BLOCK_SIZE, 2, 64), 4
    arena, pairs = kv_arena(MemfdBackend(), shape, torch.float32, layers)
    chunks = arena.stats().chunks
    assert arena.bytes_per_block == BLOCK_BYTES and chunks >= 8 * layers
    assert arena.pool.chunk_size * chunks >= 2 * layers * tensor_bytes(shape, torch.float32)
    arena.sleep()
    assert arena.blocks_ready == 0 and arena.pool.unmapped_chunks == chunks
    arena.wake_up(FIRST)
    first = arena.blocks_ready
    assert FIRST <= first < BLOCKS and 0 < arena.chunks_left < chunks - 2 * layers
    assert arena.stats().physical_bytes < arena.pool.chunk_size * chunks / 2
    for k, v in pairs:  # blocks [0, ready) and the scratch blocks are mapped: writable
        for t in (k, v):
            t[:first].fill_(1.0)
            t[-1].fill_(2.0)
    ready = [first]
    while arena.map_next():
        ready.append(arena.blocks_ready)
    assert ready == sorted(ready) and arena.blocks_ready == BLOCKS and not arena.chunks_left
    assert arena.pool.unmapped_chunks == 0
    for k, v in pairs:
        k.fill_(3.0)
        v.fill_(3.0)
    arena.sleep()
    arena.wake_up()  # not staged: every chunk
    assert arena.blocks_ready == BLOCKS and arena.pool.unmapped_chunks == 0


def test_staged_wake_serves_from_the_first_slice_and_brings_the_rest_online(worker,
                                                                            monkeypatch):
    served = Served(worker)
    before = served.run(prompts(3, 12), 8)
    slept = served.sleep(1)
    assert slept["bytes"][0] >= worker.kv_cache_bytes
    slow_mapping(worker, monkeypatch, 0.005)
    woke = served.wake()
    ready = woke["kv_blocks_ready"]
    assert woke["kv_blocks"] == BLOCKS and FIRST <= ready < BLOCKS
    assert woke["ranks"][0]["kv_blocks_ready"] == ready and woke["bytes"][0] < slept["bytes"][0]
    pool = served.sched.pool
    assert pool.num_online == ready and pool.stats().offline == BLOCKS - ready
    assert pool.num_free == ready and served.control.kv_growing
    assert served.sched.kv.stats().usage == 0.0
    assert served.run(prompts(3, 12), 8) == before  # served at once, from the first slice
    wait_ready(worker)
    served.run([[5, 6]], 1)  # the next poll brings the rest online
    assert pool.num_online == BLOCKS and not served.control.kv_growing
    assert pool.stats().offline == 0


def test_a_loaded_scheduler_right_after_wake_gets_no_block_past_the_ready_count(worker,
                                                                                monkeypatch):
    served = Served(worker)
    load = prompts(8, 24)  # 8 x (24 + 16) tokens: 80 blocks wanted, 64 in the cache
    before = served.run(load, 16)
    served.sleep(1)
    slow_mapping(worker, monkeypatch, 0.01)
    first = served.wake()["kv_blocks_ready"]
    served.handed_out.clear()
    assert served.run(load, 16) == before
    blocks = [b for b, _ in served.handed_out]
    # blocks came from the first slice first, then from each newly online stretch
    assert max(b for b, online in served.handed_out if online == first) < first
    assert max(blocks) >= first and len(served.online_seen) >= 3
    wait_ready(worker)
    served.run([[5, 6]], 1)
    assert served.sched.pool.num_online == BLOCKS and not served.control.kv_growing


def test_sleep_during_a_staged_wake_stops_the_mapping_first(worker, monkeypatch):
    served = Served(worker)
    before = served.run(prompts(2, 12), 6)
    served.sleep(1)
    slow_mapping(worker, monkeypatch, 0.02)
    served.wake()
    mem = worker.sleep_memory
    assert mem._mapper is not None and mem._mapper.running and mem.kv.chunks_left
    slept = served.sleep(1)  # joins the thread after its chunk, then releases what is mapped
    assert mem._mapper is None and mem.kv.pool.backend.file_bytes() == 0
    assert 0 < slept["ranks"][0]["kv_cache_bytes"] < worker.kv_cache_bytes
    assert not served.control.kv_growing
    monkeypatch.undo()
    served.wake()
    wait_ready(worker)
    assert served.run(prompts(2, 12), 6) == before
    assert served.sched.pool.num_online == BLOCKS


def test_a_failed_background_mapping_is_reported_and_serving_goes_on(worker, monkeypatch,
                                                                     caplog):
    served = Served(worker)
    before = served.run(prompts(2, 12), 6)
    served.sleep(1)
    backend = worker.sleep_memory.kv.pool.backend
    real = backend.create_chunk

    def create_chunk(size: int):
        if threading.current_thread().name.startswith("raygraph-kv-map"):
            raise VmmError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY")
        return real(size)

    monkeypatch.setattr(backend, "create_chunk", create_chunk)
    first = served.wake()["kv_blocks_ready"]
    deadline = time.monotonic() + 10
    while worker.sleep_memory._mapper.running:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    with pytest.raises(KVMapError, match=r"rank 0: mapping the KV cache after wake failed at "
                       rf"{first} of {BLOCKS} blocks: VmmError: .*OUT_OF_MEMORY"):
        worker.kv_blocks_ready()
    time.sleep(2 * KV_POLL_S)  # the loop polls before its first step
    with caplog.at_level(logging.ERROR, logger="raygraph.coordinator"):
        assert served.run(prompts(2, 12), 6) == before  # the first slice serves
    assert not served.control.kv_growing and "OUT_OF_MEMORY" in served.control.kv_error
    assert f"serving with {first} of {BLOCKS} KV blocks" in caplog.text
    assert served.sched.pool.num_online == first
    monkeypatch.undo()
    served.sleep(1)  # a sleep and wake maps the whole cache again
    served.wake()
    wait_ready(worker)
    assert served.run(prompts(2, 12), 6) == before and served.control.kv_error is None
    assert served.sched.pool.num_online == BLOCKS


def test_without_staged_wake_the_whole_cache_is_mapped_before_wake_returns():
    w = Worker(config(staged=False), 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(BLOCKS)
    w.sleep(1)
    woke = w.wake_up()
    assert woke.kv_blocks_ready == BLOCKS == w.kv_blocks_ready()
    assert woke.kv_cache_bytes == w.memory_stats().kv_cache_vmm.physical_bytes
    assert w.sleep_memory._mapper is None and w.sleep_memory.kv.pool.unmapped_chunks == 0
