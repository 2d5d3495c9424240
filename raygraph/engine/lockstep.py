"""Lockstep capture: every rank of the group captures the same key at the same time.

Warm-up runs execute real collectives and the collectives recorded in each rank's graph
must match, or replay deadlocks or corrupts. So for each key: a barrier (every rank checks
the key against its own schedule before any collective is issued), then all ranks capture,
then their CaptureRecords are compared. Any failure names the key and the rank; a rank
that dies or stalls is reported within the timeout instead of hanging the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import ray

from raygraph.errors import last_line
from raygraph.protocol import BucketKey, BufferInfo, CaptureRecord


class CaptureError(RuntimeError):
    """Lockstep capture failed; the message names the key, the ranks and the reason."""


class KeyReport(msgspec.Struct, frozen=True):
    """One row of the capture table: what the ranks captured for one key."""

    key: BucketKey
    agree: bool
    pieces: int
    nodes: int | None
    collectives: int
    pool_bytes: int  # the largest over ranks
    seconds: float  # wall time of the whole lockstep round for this key
    difference: str | None = None


def _describe(record: CaptureRecord) -> dict[str, Any]:
    """The fields that must be equal on every rank (addresses may differ across processes)."""
    return {
        "key": record.key,
        "pieces": record.pieces,
        "nodes": record.nodes,
        "buffers": [(b.name, b.shape) for b in record.buffers],
    }


def first_difference(records: Sequence[CaptureRecord]) -> str | None:
    """The first way a rank's record differs from rank 0's, in words; None if all agree."""
    ref = records[0]
    for r in records[1:]:
        a, b = _describe(ref), _describe(r)
        for field in a:
            if a[field] != b[field]:
                return f"{field}: rank {ref.rank} has {a[field]}, rank {r.rank} has {b[field]}"
        ca, cb = ref.collectives, r.collectives
        for i in range(max(len(ca), len(cb))):
            x = ca[i] if i < len(ca) else None
            y = cb[i] if i < len(cb) else None
            if x != y:
                return (f"collective #{i}: rank {ref.rank} issued {x}, "
                        f"rank {r.rank} issued {y}")
    return None


def moved_buffers(first: list[BufferInfo], now: list[BufferInfo]) -> str | None:
    """Persistent buffers are allocated once; a graph over a moved buffer reads stale memory."""
    before = {b.name: b.address for b in first}
    for b in now:
        if before.get(b.name, b.address) != b.address:
            return f"persistent buffer {b.name!r} moved from {before[b.name]:#x} to {b.address:#x}"
    return None


CallAll = Callable[[str, BucketKey], list[Any]]  # method, key -> one result per rank


def remote_call_all(workers: Sequence[Any], timeout: float) -> CallAll:
    """Call `method(key)` on every rank with plain actor calls (before the step loop's
    compiled graph exists). The first rank to fail, or the timeout, is a CaptureError naming
    the ranks (the others may be blocked in a collective: the caller tears the group down)."""

    def call(method: str, key: BucketKey) -> list[Any]:
        refs = [getattr(w, method).remote(key) for w in workers]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        remaining, deadline = list(refs), time.monotonic() + timeout
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1,
                                        timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stalled = sorted(rank_of[r] for r in remaining)
                raise CaptureError(f"{method} of {key}: rank(s) {stalled} did not finish within "
                                   f"{timeout:.0f}s (stalled or blocked in a collective)")
            try:
                ray.get(ready[0])
            except Exception as err:
                raise CaptureError(f"{method} of {key} failed on rank {rank_of[ready[0]]}: "
                                   f"{type(err).__name__}: {last_line(err)}") from None
        return ray.get(refs)

    return call


class LockstepCapture:
    """Drives capture key by key over one group of workers and keeps the per-key table."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.reports: list[KeyReport] = []
        self.captured: set[BucketKey] = set()
        self._buffers: dict[int, list[BufferInfo]] = {}  # rank -> buffers at its first key

    def capture(self, key: BucketKey, call_all: CallAll) -> KeyReport:
        """Capture `key` on every rank through `call_all` (plain actor calls at start-up,
        the step loop's compiled graph afterwards)."""
        t0 = time.perf_counter()
        call_all("prepare_capture", key)  # the barrier
        records: list[CaptureRecord] = call_all("capture", key)
        diff = first_difference(records)
        for r in records:
            diff = diff or moved_buffers(self._buffers.setdefault(r.rank, r.buffers), r.buffers)
        ref = records[0]
        report = KeyReport(
            key=key, agree=diff is None, pieces=ref.pieces, nodes=ref.nodes,
            collectives=len(ref.collectives), pool_bytes=max(r.pool_bytes for r in records),
            seconds=round(time.perf_counter() - t0, 4), difference=diff,
        )
        self.reports.append(report)
        if diff is not None:
            raise CaptureError(f"capture of {key}: ranks disagree: {diff}")
        self.captured.add(key)
        return report


def format_table(reports: Sequence[KeyReport]) -> str:
    """The per-key table `raygraph check-capture` prints."""
    rows = [f"{'key':<24} {'agree':<6} {'pieces':>6} {'nodes':>7} {'colls':>6} "
            f"{'MiB':>8} {'s':>7}"]
    for r in reports:
        key = f"{r.key.phase}({r.key.num_tokens},{r.key.num_comm_tokens})"
        rows.append(f"{key:<24} {'yes' if r.agree else 'NO':<6} {r.pieces:>6} "
                    f"{r.nodes if r.nodes is not None else '-':>7} {r.collectives:>6} "
                    f"{r.pool_bytes / 2**20:>8.1f} {r.seconds:>7.3f}")
        if r.difference:
            rows.append(f"    difference: {r.difference}")
    return "\n".join(rows)
