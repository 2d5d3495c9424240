"""Weight offload: weights live in (pinned) host memory, a capped GPU budget holds the ones
in use, and copies overlap compute on a copy stream.

Hooked from the outside: the big linear weights leave the model's parameters and each
module's `weight` becomes a property whose read loads it, checks the order and issues
prefetches (a read, not a module call, because fused ops read a submodule's weight from
the parent's forward). The kernel of read j is enqueued by the time read j+1 happens. The
model code knows nothing about it. The access order is recorded from one forward at load; the
floor (offload_plan.compute_floor) is checked against the budget before anything runs.

Modes (OffloadConfig.mode): `sync` copies each weight on the compute stream right before
its kernel (the baseline); `lru` is a capped pool with LRU eviction and prefetch of the
next weight on a copy stream (eager only: addresses change between steps); `ring` gives
every weight a fixed address in a ring (offload_ring.py), so the whole forward, copies
included, is captured into the graphs the executor already makes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import msgspec
import torch
from torch import nn

from raygraph.config import OffloadConfig
from raygraph.memory.offload_plan import (
    ALIGN,
    LruPool,
    OffloadError,
    OffloadOrderError,
    WeightSpec,
    aligned,
    check_order,
    compute_floor,
)
from raygraph.memory.offload_streams import StallTimer, Streams
from raygraph.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
)

log = logging.getLogger("raygraph.offload")

# modules whose forward reads its whole `weight` in one GEMM; embeddings (sparse row
# reads) stay resident
OFFLOADABLE = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


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


def check_host_weights(expected: list[WeightSpec], host: dict[str, torch.Tensor]) -> None:
    """Host tensors from any source must match what the model expects, by name."""
    missing = [s.name for s in expected if s.name not in host]
    if missing:
        raise OffloadError(f"host weights lack {missing[:8]}")
    for s in expected:
        got = spec_of(s.name, host[s.name])
        if got.shape != s.shape:
            raise OffloadError(f"weight {s.name!r} has shape {got.shape} on the host; the "
                               f"model expects {s.shape}")
        if got.dtype != s.dtype:
            raise OffloadError(f"weight {s.name!r} has dtype {got.dtype} on the host; the "
                               f"model expects {s.dtype}")


def offload_targets(model: nn.Module) -> dict[str, nn.Module]:
    """Modules whose weight is offloaded, by weight name. A weight shared with a module
    that stays resident (tied embeddings) stays resident too."""
    targets = {f"{n}.weight": m for n, m in model.named_modules()
               if isinstance(m, OFFLOADABLE)}
    kept = {id(p) for n, m in model.named_modules() if f"{n}.weight" not in targets
            for p in m.parameters(recurse=False)}
    return {n: m for n, m in targets.items() if id(m.weight) not in kept}


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


def _unloaded(name: str) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        raise OffloadError(f"weight {name!r} is offloaded and no engine is installed")

    return read


def take_host_weights(model: nn.Module, targets: dict[str, nn.Module],
                      device: torch.device) -> dict[str, torch.Tensor]:
    """Move each target weight out of the model into host memory (pinned when the device is
    a GPU, so copies are asynchronous DMA)."""
    host = {}
    for name, m in targets.items():
        w = m.weight.detach().to("cpu").contiguous()
        host[name] = w.pin_memory() if device.type == "cuda" else w
        install_reader(m, _unloaded(name))
    return host


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


class SyncEngine(OffloadEngine):
    """The baseline: one staging slot; each weight is copied on the compute stream right
    before its kernel, so nothing overlaps. Capturable (one address per weight)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        size = self._largest()
        self.region = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.slots = [region_view(self.region, 0, s) for s in self.specs]

    def _enter(self, j: int) -> torch.Tensor:
        with self.stall.measure():
            self.slots[j].copy_(self.host[j], non_blocking=True)
        return self.slots[j]


class LruEngine(OffloadEngine):
    """A capped pool of per-weight allocations: hits reuse the resident copy, misses evict
    the least recently used weights, and the next weight in the recorded order is
    prefetched on the copy stream while this one's kernel runs. Addresses change from step
    to step, so this mode never runs inside a graph (`ServeConfig.uses_graphs`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._largest()
        size = min(self.capacity, sum(aligned(s.nbytes) for s in self.specs))
        self.pool = LruPool(size)
        self.region = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.index = {n: j for j, n in enumerate(self.names)}
        self.bytes_copied = 0

    def evicted(self) -> int:
        return self.pool.evictions

    def copied_total(self) -> int:
        return self.bytes_copied

    def _load(self, j: int, pinned: set[str]) -> int | None:
        placed = self.pool.place(self.names[j], self.specs[j].nbytes, pinned)
        if placed is None:
            return None
        off, evicted = placed
        self.streams.copy_in(region_view(self.region, off, self.specs[j]), self.host[j], j,
                             [self.index[n] for n in evicted])
        self.bytes_copied += self.specs[j].nbytes
        return off

    def _enter(self, j: int) -> torch.Tensor:
        off = self.pool.lookup(self.names[j])
        if off is None:
            self.misses += 1
            off = self._load(j, pinned=set())
        else:
            self.hits += 1
        with self.stall.measure():
            self.streams.wait_copied(j)
        nxt = (j + 1) % self.n
        if nxt != j and self.names[nxt] not in self.pool.where:
            if self._load(nxt, pinned={self.names[j]}) is None:
                self.prefetch_skipped += 1
        return region_view(self.region, off, self.specs[j])

    def _retire(self, j: int) -> None:
        self.streams.mark_computed(j)


def record_order(model: nn.Module, body: nn.Module, targets: dict[str, nn.Module],
                 host: dict[str, torch.Tensor], device: torch.device,
                 forward: Callable[[], None]) -> tuple[list[str], int]:
    """Run one forward with synchronous loads and return (access order, accesses inside
    `body`). Body accesses must come first: the engine joins its copies at the body's end."""
    order: list[str] = []
    inside: list[bool] = []
    state = {"body": False}
    loaded: dict[str, torch.Tensor] = {}

    def recorder(name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            if not order or order[-1] != name:  # repeated reads by one kernel count once
                order.append(name)
                inside.append(state["body"])
                loaded.clear()  # one weight on the device at a time
                loaded[name] = host[name].to(device)
            return loaded[name]

        return read

    for name, m in targets.items():
        install_reader(m, recorder(name))
    hooks = [body.register_forward_pre_hook(lambda m, a: state.update(body=True)),
             body.register_forward_hook(lambda m, a, o: state.update(body=False))]
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
        for name, m in targets.items():
            install_reader(m, _unloaded(name))
    check_order(order, list(targets))
    body_len = sum(inside)
    if inside != [True] * body_len + [False] * (len(inside) - body_len):
        raise OffloadError("offloaded weights outside the model body must come after it "
                           f"(recorded: {order[:4]}...)")
    return order, body_len


def engine_class(mode: str) -> type[OffloadEngine]:
    from raygraph.memory.offload_ring import RingEngine

    return {"sync": SyncEngine, "lru": LruEngine, "ring": RingEngine}[mode]


def apply_offload(model: nn.Module, body: nn.Module, cfg: OffloadConfig, device: torch.device,
                  forward: Callable[[], None],
                  host: dict[str, torch.Tensor] | None = None) -> OffloadEngine:
    """Offload `model` (built on CPU) onto `device` under cfg.budget_bytes.

    The target weights move to host memory (or are taken from `host`, checked by name,
    shape and dtype), everything else moves to `device`, one forward records the access
    order (`forward` runs the model once, e.g. a one-token dummy step), the floor is
    checked, and the mode's engine is installed.
    """
    targets = offload_targets(model)
    if not targets:
        raise OffloadError("the model has no offloadable weights")
    if host is None:
        host = take_host_weights(model, targets, device)
    else:
        check_host_weights([spec_of(n, m.weight) for n, m in targets.items()], host)
        for n, m in targets.items():
            install_reader(m, _unloaded(n))
    model.to(device)
    resident = sum(aligned(p.numel() * p.element_size()) for p in model.parameters())
    order, body_len = record_order(model, body, targets, host, device, forward)
    engine = engine_class(cfg.mode)(body, targets, host, order, body_len, cfg, resident,
                                    device)
    floor = engine.floor
    log.info("offload %s: %d weights (%.1f MiB) in host memory, budget %.1f MiB, floor "
             "%.1f MiB (%s + %s), %.1f MiB resident, alignment %d", cfg.mode, len(order),
             engine.offloaded_bytes / 2**20, engine.budget / 2**20,
             floor.bytes / 2**20, *floor.pair, resident / 2**20, ALIGN)
    return engine
