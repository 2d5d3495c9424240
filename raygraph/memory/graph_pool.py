"""Where captured graphs keep their memory: the seam between the executor and the allocator.

The executor wraps each capture (every piece of one bucket) in `pool.capture(key)` and
passes what it yields to `CUDAGraph.capture_begin(pool=...)`. Three pools (the executor's
`make_graph_pool` picks one by `GraphConfig.pool`):
- `torch`: torch's one shared graph pool; later captures reuse what earlier ones freed.
- `private`: a fresh torch pool per capture; nothing is shared (the baseline).
- `vmm`: a virtual range per capture over one set of physical chunks (memory/vmm.py), in
  memory/vmm_allocator.py: physical memory is the largest capture, it can be budgeted and it
  can sleep.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from raygraph.memory.stats import GraphPoolStats
from raygraph.protocol import BucketKey


class GraphPoolError(RuntimeError):
    pass


def key_name(key: BucketKey) -> str:
    return f"{key.phase}:{key.num_tokens}:{key.num_comm_tokens}"


class GraphPool(ABC):
    """Hands each capture its pool and accounts what each capture holds."""

    kind: str

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capture_bytes: dict[str, int] = {}  # key -> bytes that capture's graphs hold
        self.last_growth = 0  # bytes the last capture added to the device memory held

    @contextmanager
    def capture(self, key: BucketKey) -> Iterator[Any]:
        """Yields the pool argument for capture_begin; accounts the capture on success."""
        before = self.held_bytes()
        with self._scope() as (pool, footprint):
            yield pool
        self.last_growth = self.held_bytes() - before
        self.capture_bytes[key_name(key)] = self.last_growth if footprint is None else footprint()

    @abstractmethod
    def _scope(self) -> Any:
        """Context manager yielding (pool for capture_begin, () -> bytes this capture holds,
        or None: what the capture added to the pool)."""

    @abstractmethod
    def held_bytes(self) -> int:
        """Device memory all graphs of this pool hold now."""

    def stats(self) -> GraphPoolStats:
        return GraphPoolStats(kind=self.kind, held_bytes=self.held_bytes(),
                              capture_bytes=dict(self.capture_bytes))

    @property
    def asleep(self) -> bool:
        return False

    def sleep(self) -> None:
        raise GraphPoolError(f"graph pool {self.kind!r} cannot sleep; use pool 'vmm'")

    def wake_up(self) -> None:
        raise GraphPoolError(f"graph pool {self.kind!r} cannot sleep; use pool 'vmm'")

    def release(self) -> None:  # noqa: B027 - torch pools go with their graphs
        """Give memory back; call after every graph of this pool was dropped."""


def _segment_bytes(device: torch.device, pool_ids: set[tuple[int, int]]) -> int:
    """Bytes of the caching allocator's segments that belong to the given pools."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if s["device"] == device.index and tuple(s["segment_pool_id"]) in pool_ids)


class TorchGraphPool(GraphPool):
    kind = "torch"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.handle = torch.cuda.graph_pool_handle()

    @contextmanager
    def _scope(self) -> Iterator[tuple[Any, Any]]:
        # shared: a capture's own footprint is unknowable; what it added is the honest figure
        yield self.handle, None

    def held_bytes(self) -> int:
        return _segment_bytes(self.device, {tuple(self.handle)})


class PrivateGraphPool(GraphPool):
    kind = "private"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.handles: list[tuple[int, int]] = []

    @contextmanager
    def _scope(self) -> Iterator[tuple[Any, Any]]:
        handle = torch.cuda.graph_pool_handle()
        self.handles.append(tuple(handle))
        yield handle, lambda: _segment_bytes(self.device, {tuple(handle)})

    def held_bytes(self) -> int:
        return _segment_bytes(self.device, set(self.handles))
