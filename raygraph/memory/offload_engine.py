"""What every offload mode shares: each offloaded module's `weight` read routed to the
engine (`install_reader`), the check that reads follow the recorded order, and the stats.
A mode (memory/offload.py: sync, lru; memory/offload_ring.py: ring) subclasses
OffloadEngine and decides where weights live and when they are copied."""

from __future__ import annotations

import functools
from collections.abc import Callable

import msgspec
import torch
from torch import nn

from raygraph.config import OffloadConfig
from raygraph.memory.offload_plan import (
    OffloadError,
    OffloadOrderError,
    WeightSpec,
    aligned,
    compute_floor,
)
from raygraph.memory.offload_streams import StallTimer, Streams


class OffloadStats(msgspec.Struct, frozen=True):
    mode: str
    budget_bytes: int
    floor_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    steps: int
    bytes_copied: int
    bytes_per_step: float
    h2d_gbps: float  # bytes copied / step wall time
    stall_s: float | None  # compute waiting on copies; None where it runs inside graphs
    hits: int
    misses: int
    hit_rate: float
    evictions: int
    prefetch_skipped: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(name: str, t: torch.Tensor) -> WeightSpec:
    return WeightSpec(name, tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size())


@functools.cache
def _reading_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with `weight` as a property that asks the offload engine for the tensor."""
    return type(cls.__name__, (cls,), {"weight": property(lambda m: m.offload_read()),
                                       "reads_offloaded": True})


def install_reader(m: nn.Module, read: Callable[[], torch.Tensor]) -> None:
    """Route every read of m.weight through `read` (the weight is no parameter any more);
    installing again (recorder, then engine) swaps `read`, not the class."""
    m._parameters.pop("weight", None)
    if not getattr(type(m), "reads_offloaded", False):
        m.__class__ = _reading_class(type(m))
    object.__setattr__(m, "offload_read", read)


def region_view(region: torch.Tensor, offset: int, spec: WeightSpec) -> torch.Tensor:
    """The weight's tensor at `offset` bytes into a uint8 region."""
    dtype = getattr(torch, spec.dtype)
    return region[offset: offset + spec.nbytes].view(dtype).view(spec.shape)


class OffloadEngine:
    """Hooks, the order check and stats; subclasses decide where weights live and when
    they are copied.

    `order` is the recorded access order; accesses [0, body_len) run inside `body` (the
    decoder stack), the rest (the LM head) after it, possibly as a separate eager call.
    """

    def __init__(self, body: nn.Module, targets: dict[str, nn.Module],
                 host: dict[str, torch.Tensor], order: list[str], body_len: int,
                 cfg: OffloadConfig, resident: int, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.names = order
        self.modules = [targets[n] for n in order]
        self.host = [host[n] for n in order]
        self.specs = [spec_of(n, host[n]) for n in order]
        self.offloaded_bytes = sum(s.nbytes for s in self.specs)
        self.n, self.body_len = len(order), body_len
        self.resident = resident
        self.floor = compute_floor(self.specs, resident)
        self.budget = cfg.budget_bytes or 0
        if cfg.check_floor:  # before any subclass takes device memory
            self.floor.check(self.budget)
        self.streams = Streams(device, self.n)
        self.stall = StallTimer(self.streams.cuda)
        self.pos = 0
        self.in_body = False
        self.steps = 0
        self.step_seconds = 0.0
        self.hits = self.misses = self.prefetch_skipped = 0
        self.open: int | None = None  # the last read; its kernel may not be enqueued yet
        self.views: list[torch.Tensor | None] = [None] * self.n
        self.hooks = [body.register_forward_pre_hook(lambda m, a: self._begin()),
                      body.register_forward_hook(lambda m, a, o: self._end())]
        for j, m in enumerate(self.modules):
            install_reader(m, lambda j=j: self._read(j))
            if j >= body_len:  # head modules end their own segment
                self.hooks.append(m.register_forward_hook(lambda m, a, o: self._close()))

    @property
    def capacity(self) -> int:
        """Bytes left for offloaded weights once the resident ones are placed."""
        return self.budget - self.resident

    def _check(self, j: int) -> int:
        """Raise unless access j is the next one in the recorded order."""
        if not self.in_body and self.pos in (self.body_len, self.n):
            self.pos = self.body_len  # the head, after a live or a replayed body
        if j != self.pos or (j < self.body_len) != self.in_body:
            want = self.names[self.pos] if self.pos < self.n else "nothing"
            raise OffloadOrderError(f"forward read weight {self.names[j]!r} where the recorded "
                                    f"order has {want!r} (access {self.pos})")
        self.pos += 1
        return j

    def _largest(self) -> int:
        """Aligned bytes of the largest weight; below that no mode can run at all."""
        big = max(range(self.n), key=lambda i: self.specs[i].nbytes)
        size = aligned(self.specs[big].nbytes)
        if size > self.capacity:
            raise OffloadError(f"weight {self.names[big]!r} needs {size} bytes; the budget "
                               f"leaves {self.capacity}")
        return size

    def _read(self, j: int) -> torch.Tensor:
        if j == self.open:  # the same kernel reading again (e.g. .shape, then the GEMM)
            return self.views[j]
        self._check(j)
        if self.open is not None:
            self._retire(self.open)
        self.open = j
        self.views[j] = self._enter(j)
        return self.views[j]

    def _begin(self) -> None:
        self.in_body, self.pos, self.open = True, 0, None

    def _end(self) -> None:
        self.in_body = False
        self._close()
        if self.pos != self.body_len:
            raise OffloadOrderError(f"forward ended without reading weight "
                                    f"{self.names[self.pos]!r} (access {self.pos})")

    def _close(self) -> None:
        """End of a segment (body, head module, piecewise split): the last read's kernel
        is enqueued."""
        if self.open is not None:
            self._retire(self.open)
            self.open = None

    def _enter(self, j: int) -> torch.Tensor:
        """Make weight j readable on the compute stream; return it."""
        raise NotImplementedError

    def _retire(self, j: int) -> None:
        """The kernel that reads weight j is enqueued."""

    def copied_per_step(self) -> int:
        """Bytes one step copies (static modes: every offloaded weight, every step)."""
        return self.offloaded_bytes

    def copied_total(self) -> int:
        """Bytes copied over all steps so far."""
        return self.steps * self.copied_per_step()

    def note_step(self, seconds: float) -> None:
        """Account one executed step of `seconds` wall time (the worker calls this)."""
        self.steps += 1
        self.step_seconds += seconds

    def stats(self) -> OffloadStats:
        copied = self.copied_total()
        lookups = self.hits + self.misses
        return OffloadStats(
            mode=self.cfg.mode, budget_bytes=self.budget, floor_bytes=self.floor.bytes,
            resident_bytes=self.resident, offloaded_bytes=self.offloaded_bytes,
            steps=self.steps, bytes_copied=copied,
            bytes_per_step=copied / self.steps if self.steps else 0.0,
            h2d_gbps=copied / self.step_seconds / 1e9 if self.step_seconds else 0.0,
            stall_s=self.stall.collect() if self.stall.measured else None,
            hits=self.hits, misses=self.misses, hit_rate=self.hits / lookups if lookups else 0.0,
            evictions=self.evicted(), prefetch_skipped=self.prefetch_skipped,
        )

    def evicted(self) -> int:
        """Weights evicted so far (only a capped pool evicts)."""
        return 0

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
