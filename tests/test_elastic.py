"""Elastic replicas on local Ray with the built-in model: a replica past min_replicas sleeps
when idle and wakes for the part of a burst past the awake replica's batch (same greedy
tokens); `scale` starts replicas and drains and stops them at run time."""

from __future__ import annotations

import sys
import time

import pytest

from raygraph.client.connect import start_coordinator
from raygraph.config import CacheConfig, ReplicaConfig, SchedulerConfig, ServeConfig
from raygraph.errors import BadRequest
from raygraph.protocol import SamplingParams, replica_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")

PROMPTS = [[5 + i, 9, 11, 13 + i, 7] * (1 + i % 2) for i in range(3)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def coord(ray_session):
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=4, num_blocks=64),
                      scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                max_model_len=256),
                      replica=ReplicaConfig(replicas=2, min_replicas=1, idle_sleep_s=0.5,
                                            routing="load", max_replicas=3,
                                            upscale_delay_s=0.5),
                      coordinator_name="elastic-test", step_timeout_s=60)
    handle = start_coordinator(cfg)
    yield handle
    ray_session.get(handle.shutdown.remote())
    ray_session.kill(handle)


def wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_an_elastic_replica_sleeps_when_idle_and_a_burst_wakes_it(ray_session, coord):
    ray = ray_session

    def replica(r: int) -> dict:
        return ray.get(coord.stats.remote())["replicas"][r]

    wait_for(lambda: replica(1)["idle_asleep"], "replica 1 never slept when idle")
    assert not replica(0)["asleep"] and not ray.get(coord.is_sleeping.remote())
    assert ray.get(coord.stats.remote())["healthy"]
    burst = [PROMPTS[i % 3] for i in range(16)]  # 8 fill replica 0's batch
    outs = ray.get(coord.generate.remote(burst, PARAMS))
    alone = [r.token_ids for r in ray.get(coord.generate.remote(PROMPTS, PARAMS))]
    assert [r.token_ids for r in outs] == [alone[i % 3] for i in range(16)]
    assert {replica_of(r.request_id) for r in outs} == {0, 1}
    woke = replica(1)
    assert woke["idle_sleeps"] >= 1 and woke["last_wake_s"] > 0
    wait_for(lambda: replica(1)["idle_asleep"], "replica 1 did not sleep again")
    assert replica(1)["idle_sleeps"] >= 2


def test_scale_up_serves_and_scale_down_drains_and_releases(ray_session, coord):
    ray = ray_session
    with pytest.raises(BadRequest, match="must be >= 1"):
        ray.get(coord.scale.remote(0))
    free = ray.available_resources().get("CPU", 0)
    out = ray.get(coord.scale.remote(3))
    assert out == {"replicas": 3, "serving": 3, "was": 2}
    assert [s.state for s in ray.get(coord.replica_states.remote())] == ["serving"] * 3
    got = ray.get(ray.get(coord.replica_states.remote())[2].engine.generate.remote(
        PROMPTS, PARAMS))
    assert [r.token_ids for r in got] == [r.token_ids for r in ray.get(
        coord.generate.remote(PROMPTS, PARAMS))]
    long = coord.generate.remote([PROMPTS[0]] * 12, SamplingParams(max_tokens=40,
                                                                   ignore_eos=True))
    time.sleep(0.2)
    assert ray.get(coord.scale.remote(1)) == {"replicas": 1, "serving": 1, "was": 3}
    assert all(len(r.token_ids) == 40 for r in ray.get(long))  # drained, none lost
    assert len(ray.get(coord.replica_states.remote())) == 1
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= free + 1,
             "the stopped replicas' placement was not released")
    assert len(ray.get(coord.generate.remote(PROMPTS, PARAMS))) == 3


def test_the_autoscaler_starts_an_elastic_replica_when_the_one_saturates(ray_session, coord):
    ray = ray_session
    ray.get(coord.scale.remote(1))  # one replica: its batch is 8, 24 requests leave 16 waiting
    ups = ray.get(coord.stats.remote())["scale_ups"]
    # 16 wait two 128-step waves: saturated across several of the autoscaler's reads
    # (every PERIOD_S) however fast the machine runs a wave
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    flood = [coord.generate.remote([PROMPTS[i % 3]], params) for i in range(24)]
    wait_for(lambda: ray.get(coord.stats.remote())["scale_ups"] == ups + 1,
             "no replica started while requests waited")
    states = ray.get(coord.replica_states.remote())
    assert len(states) == 2 and states[1].state in ("starting", "serving")
    assert all(len(r.token_ids) == 128 for out in ray.get(flood) for r in out)
    wait_for(lambda: ray.get(coord.stats.remote())["replicas"][1].get("idle_asleep"),
             "the added replica is not elastic: it did not sleep when idle")
    stats = ray.get(coord.stats.remote())
    assert stats["scale_ups"] == ups + 1 and not stats["replicas"][0]["asleep"]
