"""An engine's capture policy (Capture), and background capture: the schedule run between
served steps, busiest shapes first (BackgroundCapture).

An engine serves as soon as the weights and the KV cache are ready. Until a key is
captured on every rank (lockstep, engine/lockstep.py), steps of that key run eagerly on
every rank: the step message names the eager key, so ranks never disagree about which keys
replay. Keys are taken in order of the traffic seen so far (the decode batch sizes being
served before a large prefill bucket nobody asked for), then the rest of the schedule:
decode before prefill, small before large. Under load, capture takes at most `share` of the
step thread's time: after a capture of c seconds, steps run for c * (1 - share) / share
seconds before the next one; with nothing to serve, keys are captured back to back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from raygraph.config import ServeConfig
from raygraph.engine.lockstep import CallAll, CaptureError, KeyReport, LockstepCapture
from raygraph.graph.buckets import IDLE_TOKENS, bucket_plan
from raygraph.memory.stats import MemoryStats
from raygraph.protocol import BucketKey

log = logging.getLogger("raygraph.engine")


def _rest_order(key: BucketKey) -> tuple[int, int, int]:
    return (key.phase != "decode", key.num_tokens, key.num_comm_tokens)


class BackgroundCapture:
    def __init__(self, schedule: Iterable[BucketKey], share: float) -> None:
        """`share`: GraphConfig.capture_share."""
        if not 0 < share <= 1:
            raise ValueError(f"the capture share of the step thread must be in (0, 1], "
                             f"got {share}")
        self.pending: list[BucketKey] = sorted(schedule, key=_rest_order)
        self.total = len(self.pending)
        self.share = share
        self.seen: Counter[BucketKey] = Counter()  # steps run eagerly, per key not captured
        self.eager_steps = 0
        self.capture_s = 0.0
        self.started = time.perf_counter()
        self.finished_at: float | None = None  # perf_counter when the last key was captured
        self._next_at = 0.0  # under load, no capture before this perf_counter

    @property
    def done(self) -> bool:
        return not self.pending

    @property
    def captured(self) -> int:
        return self.total - len(self.pending)

    def missed(self, key: BucketKey) -> None:
        """A step of `key` ran eagerly because it is not captured yet: it moves up the queue.
        A key outside the schedule (an EP pair of unbalanced loads) joins it."""
        if key not in self.pending:
            self.pending.append(key)
            self.total += 1
            self.finished_at = None
        self.seen[key] += 1
        self.eager_steps += 1

    def due(self, busy: bool, now: float | None = None) -> bool:
        """Whether to capture a key now: always when idle, under load once the steps since
        the last capture have had their share of the time."""
        if not self.pending:
            return False
        return not busy or (time.perf_counter() if now is None else now) >= self._next_at

    def next_key(self) -> BucketKey:
        """The most-missed key not captured yet; without traffic, the schedule's order."""
        busiest = max(self.pending, key=lambda k: self.seen[k], default=None)
        if busiest is not None and self.seen[busiest]:
            return busiest
        return self.pending[0]

    def captured_key(self, key: BucketKey, seconds: float, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.pending.remove(key)
        self.seen.pop(key, None)
        self.capture_s += seconds
        self._next_at = now + seconds * (1 - self.share) / self.share
        if not self.pending:
            self.finished_at = now


class Capture:
    """An engine's capture policy: the whole schedule in lockstep before serving
    (`run_schedule`), or one key at a time between steps (BackgroundCapture), and what a
    step does with a key not captured yet (`prepare`, EngineCore's hook). Its hooks into the
    engine: `call(method, key)` runs one lockstep phase on every rank; `failed(err,
    recover)` is told when a capture failed (the group must be torn down: a rank may be
    blocked in a collective); `memory_stats()` reads every rank's memory once the schedule
    is complete."""

    def __init__(self, cfg: ServeConfig, call: CallAll,
                 failed: Callable[[CaptureError, bool], None],
                 memory_stats: Callable[[], list[MemoryStats]]) -> None:
        self.mode = cfg.graph.capture
        self.buckets = bucket_plan(cfg)
        self.lockstep = LockstepCapture(cfg.parallel.world_size)
        self.background = None
        if self.buckets is not None and self.mode == "background":
            self.background = BackgroundCapture(self.buckets.schedule(), cfg.graph.capture_share)
        self.call = call
        self.failed = failed
        self.memory_stats = memory_stats
        self.capture_s = 0.0
        self.memory: list[MemoryStats] = []  # per rank, after the capture schedule
        self.progress = (0, 0)  # keys captured, of the schedule

    def run_schedule(self) -> list[KeyReport]:
        """Capture the whole schedule in lockstep, largest first; returns the per-key table.
        On any disagreement, failure or stall CaptureError names the key and rank (the
        engine tore the group down; `start()` may then be called again)."""
        if self.buckets is None:
            raise RuntimeError("no graph-mode worker group to capture on")
        keys = self.buckets.schedule()
        t0 = time.perf_counter()
        for i, key in enumerate(keys, 1):
            if key not in self.lockstep.captured:
                r = self.capture_key(key)
                log.debug("capture %d/%d %s: ranks agree, %d graph(s), %s nodes, "
                          "%d collectives, %.1f MiB, %.2fs", i, len(keys), key, r.pieces,
                          r.nodes, r.collectives, r.pool_bytes / 2**20, r.seconds)
            self.progress = (i, len(keys))
        self.capture_s += time.perf_counter() - t0
        self._log_schedule(self.capture_s)
        return self.lockstep.reports

    def _log_schedule(self, seconds: float, since_serving: float | None = None) -> None:
        """Once the whole schedule is captured: memory figures and one line of totals."""
        self.memory = self.memory_stats()
        reports = self.lockstep.reports
        graphs = sum(r.pieces for r in reports)
        where = "" if since_serving is None else \
            f" in the background, complete {since_serving:.2f}s after serving started;"
        if graphs:
            log.info("capture schedule:%s %d buckets, %d graphs, %.1f MiB of graph pool in "
                     "%.2fs", where, len(reports), graphs,
                     sum(r.pool_bytes for r in reports) / 2**20, seconds)
        else:  # the eager backend (CPU): the protocol ran, nothing was captured
            log.info("capture schedule:%s %d keys checked in lockstep in %.2fs (eager "
                     "backend: no graphs)", where, len(reports), seconds)

    def prepare(self, outs: list[Any], keys: list[BucketKey | None],
                flush: Callable[[], None]) -> None:
        """EngineCore's hook, before a step is sent: a key not captured on every rank runs
        eagerly on every rank (background: the step message names the eager key, and the
        key moves up the queue), or is captured now (lazy), nothing in flight."""
        for i, key in enumerate(keys):
            if key is None or key.phase == "eager" or key in self.lockstep.captured:
                continue
            if self.background is not None:
                self.background.missed(key)
                keys[i] = BucketKey("eager", outs[i].num_tokens if outs[i] else IDLE_TOKENS,
                                    key.num_comm_tokens)
            else:
                flush()
                self.capture_key(key)

    def between_steps(self, busy: bool, flush: Callable[[], None]) -> bool:
        """Capture the next key of a background schedule if it is due; True if one was."""
        bg = self.background
        if bg is None or not bg.due(busy):
            return False
        flush()  # nothing in flight during a capture
        key = bg.next_key()
        if key in self.lockstep.captured:  # captured meanwhile (`run_schedule`)
            bg.captured_key(key, 0.0)
        else:
            t0 = time.perf_counter()
            report = self.capture_key(key, recover=True)
            bg.captured_key(key, time.perf_counter() - t0)
            log.debug("background capture %d/%d %s: %.3fs", bg.captured, bg.total, key,
                      report.seconds)
        self.capture_s = bg.capture_s
        self.progress = (bg.captured, bg.total)
        if bg.done:
            self._log_schedule(bg.capture_s, bg.finished_at - bg.started)
        return True

    def capture_key(self, key: BucketKey, recover: bool = False) -> KeyReport:
        """One key in lockstep. recover: the engine restarts its group after this fails (a
        background capture), so requests arriving during the teardown wait for it."""
        try:
            return self.lockstep.capture(key, self.call)
        except CaptureError as e:
            log.error("%s; stopping the worker group", e)
            self.failed(e, recover)
            raise

    def report(self) -> list[KeyReport]:
        """The per-key capture table so far (also after a failed capture)."""
        return list(self.lockstep.reports)

    def summary(self) -> dict:
        """Keys captured so far and in all, the steps run eagerly meanwhile, and whether
        the schedule is complete (always, once `at_start` returned)."""
        bg = self.background
        if bg is None:
            captured = len(self.lockstep.reports)
            return {"mode": self.mode, "captured": captured, "total": captured,
                    "eager_steps": 0, "done": True, "seconds": round(self.capture_s, 3)}
        return {"mode": "background", "captured": bg.captured, "total": bg.total,
                "eager_steps": bg.eager_steps, "done": bg.done,
                "seconds": round(bg.capture_s, 3),
                "complete_after_s": None if bg.finished_at is None
                else round(bg.finished_at - bg.started, 3)}
