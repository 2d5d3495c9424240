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
included, is captured into the graphs the executor already makes. The engine they share
(reads, order check, stats) is offload_engine.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from raygraph.config import OffloadConfig
from raygraph.memory.offload_engine import OffloadEngine, install_reader, region_view, spec_of
from raygraph.memory.offload_plan import (
    ALIGN,
    LruPool,
    OffloadError,
    WeightSpec,
    aligned,
    check_order,
)
from raygraph.memory.offload_ring import RingEngine
from raygraph.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
)

log = logging.getLogger("raygraph.offload")

# modules whose forward reads its whole `weight` in one GEMM; embeddings (sparse row
# reads) stay resident
OFFLOADABLE = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


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
