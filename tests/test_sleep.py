"""Sleep and wake on CPU (memfd VMM: real unmapping and remapping): a worker in this process
and the coordinator on local Ray, with the built-in model. Greedy tokens after wake equal
those before; memory is released while asleep; addresses never change."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import torch

from raygraph.client.connect import start_coordinator
from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.engine.sleep import SleepControl
from raygraph.errors import Asleep, BadRequest, Busy
from raygraph.graph.buckets import bucket_plan
from raygraph.memory.stats import SleepStats
from raygraph.protocol import SamplingParams, SeqChunk, StepPlan
from raygraph.worker.state import StateError
from raygraph.worker.worker import Worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")

BLOCKS = 64
PROMPTS = [[5 + i, 9, 11, 13 + i, 7] * (1 + i % 2) for i in range(3)]
GRAPH = GraphConfig(decode_sizes=[1, 2, 4, 8], prefill_sizes=[16, 32])


def config(mode: str = "graph", wake_first_bytes: int = 2 << 30, **kw) -> ServeConfig:
    cache = CacheConfig(block_size=4, num_blocks=BLOCKS, wake_first_bytes=wake_first_bytes)
    return ServeConfig(device="cpu", cache=cache,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                 max_model_len=256),
                       graph=GraphConfig(mode=mode, decode_sizes=GRAPH.decode_sizes,
                                         prefill_sizes=GRAPH.prefill_sizes), **kw)


@pytest.fixture(scope="module", params=["graph", "eager"])
def worker(request):
    w = Worker(config(request.param), 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(BLOCKS)
    w.capture_all()
    return w


def greedy(w: Worker) -> list[list[int]]:
    sched = Scheduler(PagePool(BLOCKS, 4), 8, 32, 256, (1,))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=8, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    for s in seqs:
        sched.add(s)
    run_to_completion(EngineCore([sched], bucket_plan(w.cfg), ep=False), local_dispatch(w))
    return [s.output_token_ids for s in seqs]


def addresses(w: Worker) -> list[int]:
    layers = w.model.attention_layers()
    return ([t.data_ptr() for layer in layers for t in (layer.k_cache, layer.v_cache)]
            + [p.data_ptr() for p in w.model.parameters()])


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wake_gives_the_same_greedy_tokens(worker, level):
    before, ptrs = greedy(worker), addresses(worker)
    mem = worker.sleep_memory
    stats = worker.sleep(level)
    assert stats.level == level and stats.kv_cache_bytes >= worker.kv_cache_bytes > 0
    assert (stats.weight_bytes >= worker.weight_bytes) == (level == 2)
    m = worker.memory_stats()
    assert m.sleep_level == level
    assert m.kv_cache_vmm.physical_bytes == 0 and m.kv_cache_vmm.asleep
    assert (m.weight_vmm.physical_bytes == 0) == (level == 2)
    assert mem.kv.pool.backend.file_bytes() == 0  # the memfd really shrank
    if level == 2:
        assert mem.weights.pool.backend.file_bytes() == 0
    with pytest.raises(StateError, match="asleep"):  # a step would fault: refused
        worker.execute(StepPlan(0, [SeqChunk(0, [5, 6], 0, [0], True)]))
    woke = worker.wake_up()
    assert woke.level == level and worker.memory_stats().sleep_level == 0
    assert addresses(worker) == ptrs
    assert greedy(worker) == before


def test_wake_maps_the_same_addresses_the_tensors_hold(worker):
    """A wake that mapped the new chunks anywhere else would leave the tensors' addresses
    unmapped: a byte written through the arena's range must read back through them."""
    k = worker.model.attention_layers()[0].k_cache
    p = next(worker.model.parameters())
    ptrs = (k.data_ptr(), p.data_ptr())
    weights = p.clone()
    worker.sleep(2)
    worker.wake_up()
    assert (k.data_ptr(), p.data_ptr()) == ptrs
    kv = worker.sleep_memory.kv
    assert kv.base == k.data_ptr()
    raw = kv.pool.backend.tensor(kv.base, 4)
    raw.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert k.view(torch.uint8).flatten()[:4].tolist() == [1, 2, 3, 4]
    assert torch.equal(p, weights)  # the host copy came back at the same address
    k.zero_()


def test_refusals_leave_the_worker_serving(worker):
    before = greedy(worker)
    with pytest.raises(ValueError, match="level"):
        worker.sleep(3)
    assert worker.wake_up().level == 0  # awake: nothing to do
    worker.sleep(1)
    with pytest.raises(StateError, match="asleep"):
        worker.sleep(2)
    worker.wake_up()
    host = worker.sleep_memory.weights.host
    worker.sleep(2)
    worker.wake_up()
    assert host is None or worker.sleep_memory.weights.host is host  # one copy, kept
    assert greedy(worker) == before


# ---- the coordinator's sleep state, with fake workers ----------------------------------
def control(in_flight: list[int], offload: bool = False, fail: bool = False):
    calls: list[str] = []

    async def on_steps(fn):
        return fn()

    def call(method: str, *args):
        calls.append(method)
        if fail and method == "sleep":
            raise RuntimeError("rank 1: no")
        if fail:  # the rank never slept: waking it maps nothing
            return [SleepStats(0, 0, 0, 0, 0, 0.0)]
        return [SleepStats(0, args[0] if args else 1, 10, 20, 0, 0.001)]

    return SleepControl(lambda: in_flight[0], on_steps, call, offload,
                        lambda: calls.append("forget_kv")), calls


def test_sleep_control_states():
    async def run():
        flight = [1]
        c, calls = control(flight)
        with pytest.raises(Busy, match="in flight"):
            await c.sleep(1, wait=False)
        c.check_admit()  # still awake
        task = asyncio.ensure_future(c.sleep(1))
        await asyncio.sleep(0.02)
        assert c.phase == "draining" and not calls
        with pytest.raises(Asleep, match="going to sleep"):
            c.check_admit()
        flight[0] = 0
        out = await task
        assert out["bytes"] == [30] and c.asleep and c.level == 1
        with pytest.raises(Asleep, match=r"asleep; POST /wake_up"):
            c.check_admit()
        assert (await c.sleep(1))["already_asleep"]
        with pytest.raises(BadRequest, match="wake_up"):
            await c.sleep(2)
        assert (await c.wake_up())["bytes"] == [30] and c.phase == "awake"
        assert (await c.wake_up())["already_awake"]
        flight[0] = 1  # wake_up while draining cancels the sleep
        task = asyncio.ensure_future(c.sleep(2))
        await asyncio.sleep(0.02)
        assert (await c.wake_up())["cancelled_sleep"]
        with pytest.raises(Busy, match="cancelled"):
            await task
        assert calls == ["sleep", "forget_kv", "wake_up"] and c.phase == "awake"
        with pytest.raises(BadRequest, match="level"):
            await c.sleep(0)

    asyncio.run(run())


def test_sleep_control_refuses_level_2_with_offload_and_recovers_from_a_failed_sleep():
    async def run():
        c, _ = control([0], offload=True)
        with pytest.raises(BadRequest, match="offload"):
            await c.sleep(2)
        c, calls = control([0], fail=True)
        with pytest.raises(RuntimeError, match="rank 1"):
            await c.sleep(1)
        # the prefix cache is kept: the KV cache was not released
        assert calls == ["sleep", "wake_up"] and c.phase == "awake" and c.level == 0

    asyncio.run(run())


def test_an_idle_sleep_wakes_for_the_next_request_and_an_operator_sleep_does_not():
    async def run():
        flight = [0]
        c, calls = control(flight)
        await c.sleep_idle(1)
        assert c.asleep and c.idle and c.idle_sleeps == 1
        await asyncio.gather(c.wake_for_request(), c.wake_for_request())  # one wake for both
        assert c.phase == "awake" and not c.idle and calls.count("wake_up") == 1
        c.check_admit()
        flight[0] = 1  # a request in flight: the idle sleep gives up, serving on
        await c.sleep_idle(1)
        assert c.phase == "awake" and not c.idle and c.idle_sleeps == 1
        flight[0] = 0
        await c.sleep(1)  # an operator's sleep: a request does not wake it
        await c.wake_for_request()
        assert c.asleep and not c.idle
        with pytest.raises(Asleep):
            c.check_admit()
        await c.sleep_idle(1)  # asleep already by the operator's call: it stays that way
        assert c.asleep and not c.idle and c.idle_sleeps == 1

    asyncio.run(run())


# ---- the coordinator on local Ray --------------------------------------------------------
@pytest.fixture(scope="module")
def coord(ray_session):
    # a staged wake: 8 blocks' worth first (16 KiB a block: 4 layers' K and V of [4, 2, 64])
    handle = start_coordinator(config(coordinator_name="sleep-test", step_timeout_s=60,
                                      wake_first_bytes=8 << 14))
    yield handle
    ray_session.get(handle.shutdown.remote())
    ray_session.kill(handle)


def served_greedy(ray, coord) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    return [r.token_ids for r in ray.get(coord.generate.remote(PROMPTS, params))]


@pytest.mark.parametrize("level", [1, 2])
def test_coordinator_sleeps_refuses_requests_without_restart_and_wakes(ray_session, coord,
                                                                        level):
    ray = ray_session
    before = served_greedy(ray, coord)
    out = ray.get(coord.sleep.remote(level))
    assert out["level"] == level and out["bytes"][0] > 0
    assert ray.get(coord.is_sleeping.remote()) and ray.get(coord.sleep_level.remote()) == level
    stats = ray.get(coord.stats.remote())
    assert stats["asleep"] and stats["sleep_level"] == level and stats["healthy"]
    (mem,) = [w["memory"] for w in ray.get(coord.worker_stats.remote())]
    assert mem["sleep_level"] == level and mem["kv_cache_vmm"]["physical_bytes"] == 0
    assert (mem["weight_vmm"]["physical_bytes"] == 0) == (level == 2)
    with pytest.raises(Asleep, match=r"asleep; POST /wake_up"):
        ray.get(coord.generate.remote([5, 6], SamplingParams(max_tokens=2)))
    stream = coord.generate_stream.options(num_returns="streaming").remote([5, 6])
    with pytest.raises(Asleep):
        for ref in stream:
            ray.get(ref)
    time.sleep(0.2)  # the step loop had its chance to (wrongly) run or restart
    woke = ray.get(coord.wake_up.remote())
    assert woke["level"] == level and woke["bytes"][0] < out["bytes"][0]  # staged
    # the mapping thread may have finished by the time the reply reads its count
    assert woke["kv_blocks"] == BLOCKS and 8 <= woke["kv_blocks_ready"] <= BLOCKS
    assert not ray.get(coord.is_sleeping.remote())
    assert served_greedy(ray, coord) == before  # not from cached blocks of the sleep
    deadline = time.time() + 10  # the step thread polls the workers every 10 ms
    while (stats := ray.get(coord.stats.remote()))["kv_cache"]["pages"]["offline"]:
        assert time.time() < deadline
        time.sleep(0.01)
    assert stats["restarts"] == 0 and stats["kv_cache"]["pages"]["cached"] > 0
    assert stats["kv_wake_error"] is None
    (mem,) = [w["memory"] for w in ray.get(coord.worker_stats.remote())]
    assert mem["kv_cache_vmm"]["physical_bytes"] == out["ranks"][0]["kv_cache_bytes"]


def test_sleep_without_wait_is_busy_with_a_request_running_and_with_wait_drains(ray_session,
                                                                                 coord):
    ray = ray_session
    long = coord.generate.remote([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    deadline = time.time() + 30
    while ray.get(coord.stats.remote())["running"] == 0:
        assert time.time() < deadline
        time.sleep(0.01)
    with pytest.raises(Busy, match="in flight"):
        ray.get(coord.sleep.remote(1, False))
    nap = coord.sleep.remote(1, True)
    time.sleep(0.05)
    with pytest.raises(Asleep):  # draining: no new work is admitted
        ray.get(coord.generate.remote([5, 6], SamplingParams(max_tokens=2)))
    out = ray.get(nap)
    (r,) = ray.get(long)
    assert len(r.token_ids) == 200 and r.finish_reason == "length"  # it finished whole
    assert out["level"] == 1 and ray.get(coord.is_sleeping.remote())
    ray.get(coord.wake_up.remote())
    assert served_greedy(ray, coord)
    assert ray.get(coord.stats.remote())["restarts"] == 0


def test_cli_sleep_and_wake_errors_are_one_line():
    from raygraph.cli import explain, main

    assert explain(Busy("2 request(s) in flight; sleep with wait=true")) == (
        1, "2 request(s) in flight; sleep with wait=true")
    assert explain(Asleep("asleep; POST /wake_up")) == (1, "asleep; POST /wake_up")
    assert explain(BadRequest("sleep level 2 is not available with weight offload"))[0] == 2
    with pytest.raises(SystemExit):
        main(["sleep", "--level", "3"])

