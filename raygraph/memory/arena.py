"""Tensors over one VMM range that can give their physical memory back and get it again at
the same virtual addresses.

Captured graphs hold the addresses of the weights and of the KV cache, so sleep cannot free
those tensors and reallocate them: it unmaps the physical chunks under a reserved range and
wake maps fresh ones at the same place. One arena is a VmmPool with a single space (the
bookkeeping, sleep and wake are the pool's); it adds typed tensor views and what happens to
the bytes: an arena that `keeps` its contents copies them to host memory at sleep and back at
wake (weights); one that does not (KV cache: requests were drained) comes back holding
whatever the new chunks hold. NOTE: no memset on wake: the driver's own page clearing already
costs ~1.7 ms/GiB (110 GiB: ~0.19 s measured on an H200) and a memset ~0.3 ms/GiB more, while
attention never reads a KV slot its sequence did not write (masked loads; the reference
zeroes what a sequence does not own), so stale bytes are never read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

from raygraph.memory.stats import VmmStats
from raygraph.memory.vmm import ALIGN, CudaBackend, MemfdBackend, VmmBackend, VmmPool

MAX_CHUNK = 1 << 30  # few large chunks: wake costs one create + map per chunk


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tensor_bytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """What a tensor takes in an arena, alignment included."""
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return _round_up(max(n, 1), ALIGN)


def vmm_backend(device: torch.device) -> VmmBackend | None:
    """The device's VMM backend (CUDA driver VMM, or a memfd on Linux CPUs); None: none."""
    if device.type == "cuda":
        return CudaBackend(device.index or 0)
    return MemfdBackend() if sys.platform.startswith("linux") else None


class VmmArena:
    """A bump allocator of tensors in one virtual range; sleep() returns its physical memory.

    Every tensor it hands out keeps the arena alive; the last one gone, the arena gives its
    range and chunks back (so no tensor can outlive the memory under it).
    """

    def __init__(self, backend: VmmBackend, nbytes: int, keep: bool,
                 chunk: int | None = None) -> None:
        # default: equal chunks of at most MAX_CHUNK (the last one is not mostly padding)
        nbytes = max(nbytes, 1)
        if chunk is None:
            chunk = _round_up(-(-nbytes // -(-nbytes // MAX_CHUNK)), backend.granularity())
        self.pool = VmmPool(backend, chunk, _round_up(nbytes, chunk))
        self.base = self.pool.new_space()
        self.keep = keep
        self.host: torch.Tensor | None = None  # the kept bytes, once a sleep copied them
        self.cuda = isinstance(backend, CudaBackend)

    @property
    def used_bytes(self) -> int:
        return self.pool.stats().space_peak_bytes[0]

    @property
    def asleep(self) -> bool:
        return self.pool.asleep

    def tensor(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of `shape` in the arena (contents: whatever the chunk holds)."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty(0, dtype=dtype).element_size()
        addr = self.pool.alloc(max(nbytes, 1))
        raw = self.pool.backend.tensor(addr, max(nbytes, 1), owner=self)
        return raw[:nbytes].view(dtype).view(shape)

    def _bytes(self) -> torch.Tensor:
        return self.pool.tensor(self.base, self.used_bytes)  # [used] uint8: every tensor

    def stats(self) -> VmmStats:
        return self.pool.stats()

    def sleep(self) -> int:
        """Unmap and release the physical chunks (the kept bytes go to host memory first:
        weights never change, so one copy serves every later sleep). Returns bytes released."""
        held = self.stats().physical_bytes
        if self.keep and self.host is None and self.used_bytes:
            self.host = torch.empty(self.used_bytes, dtype=torch.uint8, pin_memory=self.cuda)
            self.host.copy_(self._bytes())
        if self.cuda:
            torch.cuda.synchronize()  # no kernel may still touch the range
        self.pool.sleep()
        return held

    def wake_up(self) -> int:
        """Fresh chunks at the same addresses, with the kept bytes copied back (an arena
        that keeps nothing: unspecified contents). Returns bytes mapped."""
        self.pool.wake_up()
        if self.host is not None:
            self._bytes().copy_(self.host, non_blocking=True)
            if self.cuda:
                torch.cuda.synchronize()
        return self.stats().physical_bytes

    def __del__(self) -> None:
        if getattr(self, "pool", None) is None or self.pool._released:
            return
        try:
            self.pool.release()
            self.pool.backend.close()
        except Exception:  # noqa: BLE001 - interpreter exit: the driver may be gone already
            pass


def move_parameters(model: nn.Module, backend: VmmBackend,
                    skip: nn.Module | None = None) -> VmmArena:
    """Re-home every parameter (tied ones once) in an arena that keeps its contents, before
    anything captures their addresses; those `skip` holds stay where they are (another
    arena's). The old storage goes as each is moved (on a GPU the caching allocator's
    segments are emptied as the arena maps new chunks), so the peak is the weights plus
    about one chunk."""
    held = {id(p) for p in skip.parameters()} if skip is not None else set()
    params = [p for p in model.parameters() if id(p) not in held]
    arena = VmmArena(backend, sum(tensor_bytes(p.shape, p.dtype) for p in params), keep=True)
    chunks = 0
    for p in params:
        t = arena.tensor(p.shape, p.dtype)
        t.copy_(p.data)
        p.data = t
        if arena.cuda and arena.stats().chunks != chunks:
            chunks = arena.stats().chunks
            torch.cuda.empty_cache()
    if arena.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return arena
