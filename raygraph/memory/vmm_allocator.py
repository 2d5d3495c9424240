"""A VmmPool exposed to torch: one `torch.cuda.MemPool` per capture, each in a fresh range.

torch's caching allocator keeps the segments it got for a pool and reuses them within that
pool, so one MemPool shared by every capture would hand a later capture the earlier one's
addresses. Each capture therefore gets its own MemPool over a fresh `new_space()`; all
MemPools share one ctypes allocator whose callbacks bump-allocate in the current space.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from raygraph.memory.graph_pool import GraphPool, GraphPoolError
from raygraph.memory.stats import GraphPoolStats
from raygraph.memory.vmm import CudaBackend, VmmPool

log = logging.getLogger("raygraph.memory")

# void* alloc(ssize_t size, int device, void* stream); void free(void*, ssize_t, int, void*)
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int,
                           ctypes.c_void_p)


class VmmAllocator:
    """The C callbacks torch calls for segments. They must outlive every MemPool on them.

    An error cannot cross the C boundary: alloc returns NULL (torch then raises its OOM)
    and keeps the error, which the capture scope re-raises as the real cause.
    """

    def __init__(self, vmm: VmmPool) -> None:
        self.vmm = vmm
        self.error: BaseException | None = None
        self.alloc_fn = ALLOC_FN(self._alloc)
        self.free_fn = FREE_FN(self._free)

    @property
    def alloc_ptr(self) -> int:
        return ctypes.cast(self.alloc_fn, ctypes.c_void_p).value

    @property
    def free_ptr(self) -> int:
        return ctypes.cast(self.free_fn, ctypes.c_void_p).value

    def _alloc(self, size: int, device: int, stream: Any) -> int | None:
        try:
            return self.vmm.alloc(size)
        except BaseException as e:  # noqa: BLE001 - kept and re-raised by the capture scope
            self.error = e
            return None

    def _free(self, ptr: int | None, size: int, device: int, stream: Any) -> None:
        if self.vmm._released:  # torch dropping a pool after release: nothing left to give
            return
        self.vmm.free(ptr or 0)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# NOTE: torch keeps a raw pointer to the allocator and may call its free callback whenever
# it drops a pool's segments, possibly after this VmmGraphPool is gone (a graph outliving
# release()). The callbacks and torch's allocator object therefore live for the process:
# a few hundred bytes per pool; their free() is a no-op once the VmmPool was released.
_ANCHORS: list[tuple[VmmAllocator, Any]] = []


class VmmGraphPool(GraphPool):
    """Graph memory = max over captures; can be capped (budget), put to sleep and woken."""

    kind = "vmm"

    def __init__(self, device: torch.device, chunk_bytes: int,
                 budget_bytes: int | None = None) -> None:
        super().__init__(device)
        backend = CudaBackend(device.index or 0)
        chunk = _round_up(chunk_bytes, backend.granularity())
        # a range can never need more than the budget, or than the device has
        limit = (torch.cuda.get_device_properties(device).total_memory
                 if budget_bytes is None else budget_bytes)
        self.vmm = VmmPool(backend, chunk, _round_up(max(limit, chunk), chunk), budget_bytes)
        self.allocator = VmmAllocator(self.vmm)
        self.torch_allocator = torch._C._cuda_customAllocator(self.allocator.alloc_ptr,
                                                              self.allocator.free_ptr)
        _ANCHORS.append((self.allocator, self.torch_allocator))
        self.mempools: list[torch.cuda.MemPool] = []  # alive as long as their graphs

    @contextmanager
    def _scope(self) -> Iterator[tuple[Any, Any]]:
        if self.vmm.asleep:
            raise GraphPoolError("cannot capture while the graph pool is asleep; wake_up() first")
        self.vmm.new_space()
        mempool = torch.cuda.MemPool(self.torch_allocator)
        self.mempools.append(mempool)
        self.allocator.error = None
        try:
            yield mempool.id, lambda: self.vmm.stats().space_peak_bytes[-1]
        except Exception as e:
            if self.allocator.error is not None:
                raise self.allocator.error from e
            raise

    def held_bytes(self) -> int:
        return self.vmm.stats().physical_bytes

    def stats(self) -> GraphPoolStats:
        s = self.vmm.stats()
        return GraphPoolStats(
            kind=self.kind, held_bytes=s.physical_bytes, capture_bytes=dict(self.capture_bytes),
            virtual_bytes=s.virtual_bytes, spaces=s.spaces, chunks=s.chunks,
            chunk_size=s.chunk_size, budget_bytes=self.vmm.max_physical_bytes, asleep=s.asleep,
        )

    @property
    def asleep(self) -> bool:
        return self.vmm.asleep

    def sleep(self) -> None:
        """Release the physical chunks; graphs, MemPools and ranges stay. Contents are lost:
        graph-private memory holds only intermediates that every replay rewrites."""
        torch.cuda.synchronize(self.device)  # no kernel may still touch the ranges
        self.vmm.sleep()

    def wake_up(self) -> None:
        """New chunks mapped at the same addresses: every graph replays with no recapture."""
        self.vmm.wake_up()

    def release(self) -> None:
        """Drop the MemPools (torch frees their segments back through the callbacks), then
        unmap and release everything. Call after every graph of this pool was dropped."""
        torch.cuda.synchronize(self.device)
        self.mempools.clear()
        gc.collect()
        torch.cuda.empty_cache()
        if self.vmm.live_allocations:
            log.warning("releasing the VMM graph pool while torch still holds %d of its "
                        "segments (a graph outlived release()): replaying it would fault",
                        self.vmm.live_allocations)
        self.vmm.release()
