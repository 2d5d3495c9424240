"""The autoscaler's decisions (coordinator/autoscale.py) over a fleet whose engines report
the load given here: a replica starts only after every serving one was saturated for the
delay, never past max_replicas, and not while one is still starting."""

from __future__ import annotations

import asyncio

import msgspec

from raygraph.config import ReplicaConfig, ServeConfig
from raygraph.coordinator.autoscale import Autoscaler, saturated
from raygraph.protocol import ReplicaState

BUSY = {"waiting": 3, "kv_utilization": 0.5}
FULL_KV = {"waiting": 0, "kv_utilization": 0.95}
EASY = {"waiting": 0, "kv_utilization": 0.5}


class Stats:
    def __init__(self, fleet: Fleet, replica: int) -> None:
        self.fleet, self.replica = fleet, replica

    async def remote(self) -> dict:
        return self.fleet.load[self.replica]


class Engine:
    def __init__(self, fleet: Fleet, replica: int) -> None:
        self.stats = Stats(fleet, replica)


class Fleet:
    """ReplicaSet's surface the autoscaler reads and calls: `scale` records the count and
    leaves the new replica starting."""

    def __init__(self, replicas: int, max_replicas: int, delay: float) -> None:
        rc = ReplicaConfig(replicas=replicas, max_replicas=max_replicas, upscale_delay_s=delay)
        self.cfg = ServeConfig(replica=rc.pinned())
        self.states = [ReplicaState(r, Engine(self, r), "serving") for r in range(replicas)]
        self.load = [EASY] * replicas
        self.scaled: list[int] = []

    def serving(self) -> list[ReplicaState]:
        return [s for s in self.states if s.state == "serving"]

    async def scale(self, replicas: int) -> None:
        self.scaled.append(replicas)
        self.states.append(ReplicaState(len(self.states), None, "starting"))
        self.load.append(EASY)

    def started(self) -> None:
        self.states[-1] = ReplicaState(len(self.states) - 1, Engine(self, len(self.states) - 1),
                                       "serving")


def test_saturation_is_requests_waiting_or_a_full_kv_cache_and_never_asleep() -> None:
    assert saturated(BUSY) and saturated(FULL_KV) and not saturated(EASY)
    assert not saturated({**BUSY, "asleep": True})


def test_a_replica_starts_after_every_one_was_saturated_for_the_delay() -> None:
    async def run() -> None:
        fleet = Fleet(2, 3, delay=5.0)
        scaler = Autoscaler(fleet)
        fleet.load = [BUSY, EASY]  # one replica has room: nothing
        assert not await scaler.step(0.0) and scaler.since is None
        fleet.load = [BUSY, FULL_KV]
        assert not await scaler.step(1.0) and scaler.since == 1.0
        fleet.load = [BUSY, EASY]  # a break restarts the clock
        assert not await scaler.step(2.0)
        fleet.load = [BUSY, BUSY]
        assert not await scaler.step(3.0)
        assert not await scaler.step(7.9)
        assert await scaler.step(8.0) and fleet.scaled == [3] and scaler.scale_ups == 1
        fleet.load = [BUSY, BUSY, BUSY]
        assert not await scaler.step(20.0)  # the new one still starts: wait for it
        fleet.started()
        assert not await scaler.step(30.0)  # serving, saturated too: at max_replicas
        assert fleet.scaled == [3]

    asyncio.run(run())


def test_autoscaling_pins_the_awake_replicas_to_the_starting_count() -> None:
    rc = ReplicaConfig(replicas=2, max_replicas=4)
    assert rc.pinned().min_replicas == 2 and rc.pinned().awake == 2
    assert ReplicaConfig(replicas=2, max_replicas=4, min_replicas=1).pinned().min_replicas == 1
    assert ReplicaConfig(replicas=2).pinned().min_replicas is None
    resolved = ServeConfig(device="cpu", replica=rc).resolved(0)
    assert resolved.replica == msgspec.structs.replace(rc, min_replicas=2)
