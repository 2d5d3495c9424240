"""Sleep and wake of the worker group, as the coordinator's event loop sees it.

Sleep stops admitting requests, lets those in flight finish (or refuses when asked not to
wait), then every rank releases its memory at the level asked (1: graph pool and KV cache;
2: the weights too). The graphs stay captured and the tensors keep their virtual addresses,
so wake maps memory back and serving resumes with no recapture. While asleep no step runs
and new requests are refused with Asleep, never a worker-group restart.

A staged wake (CacheConfig.staged_wake) returns once the workers mapped the KV cache's first
blocks: the page pools offer only those (the rest are offline pages) and, while the workers
map the rest in the background, the step thread asks them every KV_POLL_S between steps how
far they got (the least over ranks) and brings those pages online.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from raygraph.engine.pages import PagePool
from raygraph.errors import Asleep, BadRequest, Busy, last_line
from raygraph.memory.stats import KVMapError, SleepStats

log = logging.getLogger("raygraph.coordinator")

Phase = Literal["awake", "draining", "asleep"]
KV_POLL_S = 0.01  # while a staged wake maps the KV cache: how often the workers are asked


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
    (woken, it holds no cached block's content); `pools()`: every DP group's page pool."""

    def __init__(self, in_flight: Callable[[], int],
                 on_steps: Callable[[Callable[[], Any]], Awaitable[Any]],
                 call: Callable[..., list[Any]], offload: bool,
                 forget_kv: Callable[[], Any] = lambda: None,
                 pools: Callable[[], list[PagePool]] = list) -> None:
        self.in_flight = in_flight
        self.on_steps = on_steps
        self.call = call
        self.offload = offload
        self.forget_kv = forget_kv
        self.pools = pools
        self.phase: Phase = "awake"
        self.level = 0  # the level the workers sleep at; 0 awake
        self.kv_growing = False  # a staged wake is mapping the rest of the KV cache
        self.kv_error: str | None = None  # why the background mapping stopped short
        self._woke_at = 0.0
        self._poll_at = 0.0
        self.idle = False  # asleep (or going to sleep) because idle: a request wakes it
        self.idle_sleeps = 0  # idle sleeps so far
        self.last_wake_s = 0.0  # the last wake's seconds, workers' mapping included
        self._waking: asyncio.Task | None = None

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
        """An operator's sleep: requests are refused (Asleep) until wake_up."""
        self.idle = False
        return await self._sleep(level, wait)

    async def sleep_idle(self, level: int) -> None:
        """An elastic replica with nothing in flight sleeps; its next request wakes it
        (wake_for_request). Requests that came meanwhile keep it awake."""
        if self.phase != "awake":
            return
        self.idle = True
        try:
            await self._sleep(level, wait=False)
        except Exception as e:  # busy again, or the workers could not: serve on awake
            self.idle = False
            log.info("not going to sleep when idle: %s", last_line(e))
            return
        self.idle_sleeps += 1

    async def wake_for_request(self) -> None:
        """Before admitting a request: end an idle sleep (one wake for every request that
        comes during it). An operator's sleep is left alone: check_admit refuses."""
        while self.idle and self.phase == "draining":  # an idle sleep is finishing
            await asyncio.sleep(0.002)
        if self.idle and self.phase == "asleep" and (self._waking is None
                                                      or self._waking.done()):
            self._waking = asyncio.get_running_loop().create_task(self.wake_up())
        if self._waking is not None and not self._waking.done():
            await asyncio.shield(self._waking)

    async def _sleep(self, level: int, wait: bool) -> dict:
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
                woke = self.call("wake_up")
                if any(s.kv_cache_bytes for s in woke):  # a rank's KV cache came back empty
                    self.forget_kv()
                self._bring_online(min(s.kv_blocks_ready for s in woke))  # maybe staged
            except Exception as e:
                log.error("waking the ranks after a failed sleep: %s", e)
            raise
        self.forget_kv()
        self.phase, self.level, self.kv_growing = "asleep", level, False
        return stats

    async def wake_up(self) -> dict:
        self.idle = False
        if self.phase == "draining":  # the sleep waiting for requests gives up
            self.phase = "awake"
            return {"level": 0, "cancelled_sleep": True}
        if self.phase == "awake":
            return {"level": 0, "already_awake": True}
        t0 = time.perf_counter()
        level = self.level
        stats, ready = await self.on_steps(self._wake_workers)
        pages = sum(p.num_pages for p in self.pools())
        out = summary(stats, time.perf_counter() - t0, level=level, kv_blocks=pages,
                      kv_blocks_ready=ready)
        self.last_wake_s = out["seconds"]
        log.info("awake: mapped %.1f MiB per rank again in %.3fs; %d of %d KV blocks ready%s",
                 max(out["bytes"]) / 2**20, out["seconds"], ready, pages,
                 ", the rest mapping in the background" if ready < pages else "")
        return out

    def _wake_workers(self) -> tuple[list[SleepStats], int]:
        """On the step thread: every rank wakes; returns their stats and the KV blocks
        online at once (summed over DP groups)."""
        self._woke_at = time.perf_counter()
        stats = self.call("wake_up")  # a failure leaves the group asleep: wake_up again
        self._bring_online(min(s.kv_blocks_ready for s in stats))  # before any step runs
        self.phase, self.level, self.kv_error = "awake", 0, None
        return stats, sum(p.num_online for p in self.pools())

    def _bring_online(self, ready: int) -> None:
        """Every pool offers pages [0, ready): what every rank has mapped."""
        pools = self.pools()
        for p in pools:
            p.set_online(min(ready, p.num_pages))
        growing = any(p.num_online < p.num_pages for p in pools)
        if self.kv_growing and not growing:
            log.info("the whole KV cache is back %.3fs after wake: %d blocks",
                     time.perf_counter() - self._woke_at, sum(p.num_pages for p in pools))
        self.kv_growing = growing
        self._poll_at = time.perf_counter() + KV_POLL_S

    def poll_due(self) -> bool:
        """A staged wake is mapping and the workers were last asked KV_POLL_S ago."""
        return self.kv_growing and time.perf_counter() >= self._poll_at

    def poll_kv(self) -> None:
        """On the step thread, nothing in flight: bring online the KV blocks every rank has
        mapped by now. A rank whose background mapping failed stops the polling: the group
        serves on with the blocks online (logged, in kv_error) until a sleep and wake."""
        try:
            ready = min(self.call("kv_blocks_ready"))
        except KVMapError as e:
            self.kv_growing, self.kv_error = False, last_line(e)
            log.error("%s; serving with %d of %d KV blocks (sleep and wake to map them all)",
                      self.kv_error, min(p.num_online for p in self.pools()),
                      self.pools()[0].num_pages)
            return
        self._bring_online(ready)
