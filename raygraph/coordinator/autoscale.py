"""Autoscaling, in the coordinator's process: another replica starts while every serving
replica is saturated (requests waiting for a batch slot, or its KV cache nearly full) for
`ReplicaConfig.upscale_delay_s`, up to `max_replicas`. Replicas it adds are elastic (past
min_replicas): when load falls they sleep when idle rather than being torn down, and the
next burst wakes them faster than any replica could start. `raygraph scale N` stops them.

The signal is the engines' own state, read every PERIOD_S, so it sees every front's
traffic; routers only see their own.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.exceptions import RayActorError

from raygraph.coordinator.replicas import ReplicaSet
from raygraph.errors import last_line

log = logging.getLogger("raygraph.coordinator")

PERIOD_S = 1.0  # how often the engines' load is read
KV_FULL = 0.9  # KV cache use (pinned pages of the fullest DP group) that counts as full


def saturated(stats: dict) -> bool:
    """Whether a serving engine can take no more work now: requests wait for a batch slot,
    or its KV cache is nearly full. A sleeping engine is not (a request wakes it)."""
    if stats.get("asleep"):
        return False
    return stats.get("waiting", 0) > 0 or stats.get("kv_utilization", 0.0) >= KV_FULL


class Autoscaler:
    """Watches a ReplicaSet and grows it under sustained saturation."""

    def __init__(self, fleet: ReplicaSet) -> None:
        self.fleet = fleet
        self.since: float | None = None  # saturated without a break from then
        self.scale_ups = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.fleet.cfg.replica.max_replicas is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(PERIOD_S)
            try:
                await self.step(time.monotonic())
            except Exception as e:  # a scale that failed: the next period tries again
                log.warning("autoscaling: %s: %s", type(e).__name__, last_line(e))

    async def step(self, now: float) -> bool:
        """Read the engines; start a replica if they have been saturated long enough.
        Whether one started."""
        rc = self.fleet.cfg.replica
        serving = self.fleet.serving()
        count = len(self.fleet.states)
        if not serving or count >= rc.max_replicas or count > len(serving):
            self.since = None  # full, or a replica is starting (or failed): wait for it
            return False
        try:
            stats = await asyncio.gather(*(s.engine.stats.remote() for s in serving))
        except RayActorError:
            self.since = None
            return False
        if not all(saturated(s) for s in stats):
            self.since = None
            return False
        self.since = now if self.since is None else self.since
        if now - self.since < rc.upscale_delay_s:
            return False
        log.info("every replica saturated for %.1f s: starting replica %d", now - self.since,
                 count)
        self.since = None
        self.scale_ups += 1
        await self.fleet.scale(count + 1)
        return True

