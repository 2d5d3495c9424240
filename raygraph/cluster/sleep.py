"""Sleep and wake of the worker group, as the coordinator's event loop sees it.

Sleep stops admitting requests, lets those in flight finish (or refuses when asked not to
wait), then every rank releases its memory at the level asked (1: graph pool and KV cache;
2: the weights too). The graphs stay captured and the tensors keep their virtual addresses,
so wake maps memory back and serving resumes with no recapture. While asleep no step runs
and new requests are refused with Asleep, never a worker-group restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from raygraph.cluster.requests import Asleep, BadRequest, Busy
from raygraph.memory.stats import SleepStats

log = logging.getLogger("raygraph.coordinator")

Phase = Literal["awake", "draining", "asleep"]


def summary(stats: list[SleepStats], seconds: float, **extra: Any) -> dict:
    """What the workers reported, per rank, plus the totals a client prints."""
    return {
        **extra, "seconds": round(seconds, 4),
        "worker_seconds": round(max((s.seconds for s in stats), default=0.0), 4),
        "bytes": [s.total_bytes for s in stats],
        "ranks": [msgspec.to_builtins(s) for s in stats],
    }


class SleepControl:
    """`in_flight()`: requests not finished yet; `on_steps(fn)` runs fn on the step thread
    between steps (nothing in flight); `call(method, *args)` (there) calls every worker;
    `forget_kv()` (there) drops the prefix cache once the workers released the KV cache
    (woken, it holds no cached block's content)."""

    def __init__(self, in_flight: Callable[[], int],
                 on_steps: Callable[[Callable[[], Any]], Awaitable[Any]],
                 call: Callable[..., list[Any]], offload: bool,
                 forget_kv: Callable[[], Any] = lambda: None) -> None:
        self.in_flight = in_flight
        self.on_steps = on_steps
        self.call = call
        self.offload = offload
        self.forget_kv = forget_kv
        self.phase: Phase = "awake"
        self.level = 0  # the level the workers sleep at; 0 awake

    @property
    def asleep(self) -> bool:
        """True once the workers released their memory: the step thread runs no step."""
        return self.phase == "asleep"

    def check_admit(self) -> None:
        """Refuse a new request unless awake."""
        if self.phase == "asleep":
            raise Asleep("asleep; POST /wake_up")
        if self.phase == "draining":
            raise Asleep("going to sleep (finishing the requests in flight); POST /wake_up")

    async def sleep(self, level: int = 1, wait: bool = True) -> dict:
        if level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 (graph pool and KV cache) or 2 (also "
                             f"the weights), got {level!r}")
        if level == 2 and self.offload:
            raise BadRequest("sleep level 2 is not available with weight offload "
                             "(offload.budget_bytes): the offload engine owns the weights; "
                             "use level 1")
        if self.phase == "asleep":
            if level == self.level:
                return {"level": level, "already_asleep": True}
            raise BadRequest(f"asleep at level {self.level}; POST /wake_up before sleeping "
                             f"at level {level}")
        if self.phase == "draining":
            raise Busy("already going to sleep")
        if not wait and self.in_flight():
            raise Busy(f"{self.in_flight()} request(s) in flight; sleep with wait=true to "
                       "let them finish first")
        t0 = time.perf_counter()
        self.phase = "draining"
        try:
            while self.in_flight():
                await asyncio.sleep(0.005)
                if self.phase != "draining":
                    raise Busy("sleep cancelled: wake_up was called while requests finished")
            drain_s = time.perf_counter() - t0
            stats = await self.on_steps(lambda: self._sleep_workers(level))
        except BaseException:
            if self.phase == "draining":
                self.phase = "awake"
            raise
        out = summary(stats, time.perf_counter() - t0, level=level, drain_s=round(drain_s, 4))
        log.info("asleep at level %d: released %.1f MiB per rank in %.3fs (drain %.3fs)",
                 level, max(out["bytes"]) / 2**20, out["seconds"], drain_s)
        return out

    def _sleep_workers(self, level: int) -> list[SleepStats]:
        """On the step thread: every rank sleeps; on a failure, the ranks that slept wake
        (waking an awake rank does nothing) and the group serves on."""
        try:
            stats = self.call("sleep", level)
        except BaseException:
            try:
                self.call("wake_up")
            except Exception as e:
                log.error("waking the ranks after a failed sleep: %s", e)
            raise
        self.forget_kv()
        self.phase, self.level = "asleep", level
        return stats

    async def wake_up(self) -> dict:
        if self.phase == "draining":  # the sleep waiting for requests gives up
            self.phase = "awake"
            return {"level": 0, "cancelled_sleep": True}
        if self.phase == "awake":
            return {"level": 0, "already_awake": True}
        t0 = time.perf_counter()
        level = self.level
        stats = await self.on_steps(self._wake_workers)
        out = summary(stats, time.perf_counter() - t0, level=level)
        log.info("awake: mapped %.1f MiB per rank again in %.3fs", max(out["bytes"]) / 2**20,
                 out["seconds"])
        return out

    def _wake_workers(self) -> list[SleepStats]:
        stats = self.call("wake_up")  # a failure leaves the group asleep: wake_up again
        self.phase, self.level = "awake", 0
        return stats
