"""Copy-stream plumbing for the offload engine: events between the copy and compute streams,
and the stall timer. On CPU every stream operation is a no-op (copies are synchronous)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Streams:
    """Copy-stream plumbing: per-access events, fork/join with the compute stream. On CPU
    copies are synchronous and every stream operation is a no-op."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in range(n)]
            self.computed = [torch.cuda.Event() for _ in range(n)]

    def fork(self) -> None:
        if self.cuda:
            self.copy.wait_stream(torch.cuda.current_stream())

    def join(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.copy)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, j: int, after: list[int]) -> None:
        """Copy access j's weight once the kernels of `after` have read what dst overwrites."""
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.copy):
            for k in after:
                self.copy.wait_event(self.computed[k])
            dst.copy_(src, non_blocking=True)
            self.copied[j].record(self.copy)

    def wait_copied(self, j: int) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[j])

    def mark_computed(self, j: int) -> None:
        if self.cuda:
            self.computed[j].record(torch.cuda.current_stream())


class StallTimer:
    """Time the compute stream spends waiting for weights (timing events around each wait;
    skipped inside graph capture, where time is measured per replay by the caller)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds = 0.0
        self.measured = False
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # collected: reusable

    @contextmanager
    def measure(self) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0
            self.measured = True
            return
        if torch.cuda.is_current_stream_capturing():
            yield
            return
        a, b = self.free.pop() if self.free else (torch.cuda.Event(enable_timing=True),
                                                  torch.cuda.Event(enable_timing=True))
        a.record()
        yield
        b.record()
        self.pending.append((a, b))
        self.measured = True
        if len(self.pending) > 8192:
            self.collect()

    def collect(self) -> float:
        for a, b in self.pending:
            b.synchronize()
            self.seconds += a.elapsed_time(b) / 1e3
        self.free += self.pending
        self.pending.clear()
        return self.seconds
