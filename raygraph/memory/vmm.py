"""VMM pool: one virtual address range per capture, all mapped onto one set of physical chunks.

Graphs of one executor never replay concurrently, so their memory may alias: each capture
bump-allocates in its own range and physical memory is max(shape), not sum(shape). The
backend seam lets the same bookkeeping run over a memfd on a CPU-only Linux machine
(real double mapping) and over the CUDA driver's VMM calls on a GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch

from raygraph.memory.stats import VmmStats

ALIGN = 512  # bytes; every address alloc() returns is a multiple of this


class VmmError(RuntimeError):
    pass


class VmmBackend(ABC):
    """Physical chunks, virtual reservations and the mappings between them."""

    @abstractmethod
    def granularity(self) -> int: ...

    @abstractmethod
    def create_chunk(self, size: int) -> Any: ...

    @abstractmethod
    def release_chunk(self, handle: Any, size: int) -> None: ...

    @abstractmethod
    def reserve(self, size: int) -> int: ...

    @abstractmethod
    def free_range(self, addr: int, size: int) -> None: ...

    @abstractmethod
    def map(self, addr: int, size: int, handle: Any) -> None: ...

    @abstractmethod
    def unmap(self, addr: int, size: int) -> None: ...

    @abstractmethod
    def tensor(self, addr: int, nbytes: int, owner: object = None) -> torch.Tensor:
        """A uint8 tensor over [addr, addr + nbytes); valid only while that memory is mapped.
        The tensor (and every view of it) keeps `owner` alive."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value


class MemfdBackend(VmmBackend):
    """Linux CPU backend: a chunk is a slice of one memfd; ranges are PROT_NONE reservations.

    map() places a MAP_SHARED view of the chunk at an exact address inside a reservation
    (MAP_FIXED), so every range mapping a chunk sees the same bytes.
    """

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mmap.restype = ctypes.c_void_p
        self._libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self._libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.fd = os.memfd_create("raygraph-vmm")
        self._live: dict[int, int] = {}  # chunk offset in the memfd -> size

    def granularity(self) -> int:
        return mmap.PAGESIZE

    def file_bytes(self) -> int:
        return os.fstat(self.fd).st_size

    def _mmap(
        self, addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int
    ) -> int:
        out = self._libc.mmap(addr, size, prot, flags, fd, offset)
        if out is None or out == _MAP_FAILED:
            err = ctypes.get_errno()
            raise VmmError(f"mmap(size={size}, offset={offset}) failed: {os.strerror(err)}")
        if addr is not None and out != addr:
            raise VmmError(f"mmap placed {size} bytes at {out:#x}, asked for {addr:#x}")
        return out

    def create_chunk(self, size: int) -> int:
        offset = self.file_bytes()
        os.ftruncate(self.fd, offset + size)
        self._live[offset] = size
        return offset

    def release_chunk(self, handle: int, size: int) -> None:
        if self._live.pop(handle, None) != size:
            raise VmmError(f"releasing unknown memfd chunk at offset {handle} ({size} bytes)")
        # NOTE: the file shrinks to the end of the last live chunk; holes stay until then
        os.ftruncate(self.fd, max((o + s for o, s in self._live.items()), default=0))

    def reserve(self, size: int) -> int:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        return self._mmap(None, size, _PROT_NONE, flags, -1, 0)

    def free_range(self, addr: int, size: int) -> None:
        if self._libc.munmap(addr, size) != 0:
            raise VmmError(f"munmap({addr:#x}, {size}) failed: {os.strerror(ctypes.get_errno())}")

    def map(self, addr: int, size: int, handle: int) -> None:
        self._mmap(addr, size, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, self.fd, handle)

    def unmap(self, addr: int, size: int) -> None:
        # back to an inaccessible reservation, so the range stays ours until free_range
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        self._mmap(addr, size, _PROT_NONE, flags, -1, 0)

    def tensor(self, addr: int, nbytes: int, owner: object = None) -> torch.Tensor:
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        buf._owner = owner  # torch keeps the buffer object alive, and with it the owner
        return torch.frombuffer(buf, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _CudaArray:
    """Exposes [addr, addr + nbytes) as a uint8 device array for torch.as_tensor."""

    def __init__(self, addr: int, nbytes: int, owner: object = None) -> None:
        self.owner = owner  # torch keeps this object alive as long as the tensor
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }


class CudaBackend(VmmBackend):
    """CUDA driver VMM through cuda-python: cuMemCreate / cuMemAddressReserve / cuMemMap."""

    def __init__(self, device: int = 0) -> None:
        if not torch.cuda.is_available():
            raise VmmError("CudaBackend needs a CUDA GPU; torch sees none (use MemfdBackend)")
        from cuda.bindings import driver  # lazy: GPU-only import

        self._d = driver
        self.device = device
        torch.cuda.init()
        torch.zeros(1, device=f"cuda:{device}")  # make torch's primary context current
        self._check("cuInit", driver.cuInit(0))
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device
        self._access = driver.CUmemAccessDesc()
        self._access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self._gran = int(
            self._check(
                "cuMemGetAllocationGranularity",
                driver.cuMemGetAllocationGranularity(self._prop, flag),
            )
        )

    def _check(self, name: str, result: tuple) -> Any:
        err = result[0]
        if err != self._d.CUresult.CUDA_SUCCESS:
            raise VmmError(f"{name} failed: {err!r}")
        return result[1] if len(result) == 2 else None

    def _ptr(self, addr: int) -> Any:
        return self._d.CUdeviceptr(addr)

    def granularity(self) -> int:
        return self._gran

    def create_chunk(self, size: int) -> Any:
        return self._check("cuMemCreate", self._d.cuMemCreate(size, self._prop, 0))

    def release_chunk(self, handle: Any, size: int) -> None:
        self._check("cuMemRelease", self._d.cuMemRelease(handle))

    def reserve(self, size: int) -> int:
        ptr = self._check(
            "cuMemAddressReserve", self._d.cuMemAddressReserve(size, self._gran, self._ptr(0), 0)
        )
        return int(ptr)

    def free_range(self, addr: int, size: int) -> None:
        self._check("cuMemAddressFree", self._d.cuMemAddressFree(self._ptr(addr), size))

    def map(self, addr: int, size: int, handle: Any) -> None:
        self._check("cuMemMap", self._d.cuMemMap(self._ptr(addr), size, 0, handle, 0))
        self._check(
            "cuMemSetAccess", self._d.cuMemSetAccess(self._ptr(addr), size, [self._access], 1)
        )

    def unmap(self, addr: int, size: int) -> None:
        self._check("cuMemUnmap", self._d.cuMemUnmap(self._ptr(addr), size))

    def tensor(self, addr: int, nbytes: int, owner: object = None) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(addr, nbytes, owner), device=f"cuda:{self.device}")


class _Space:
    def __init__(self, base: int) -> None:
        self.base = base
        self.mapped = 0  # chunks mapped at the start of this range
        self.peak = 0  # bump pointer: bytes used, aligned


class VmmPool:
    """Bump allocator over per-capture virtual ranges that share physical chunks.

    free() only checks the address: a graph pool never hands memory back mid-capture;
    the next new_space() starts over at offset 0 on the same physical chunks.
    `max_physical_bytes` caps the physical chunks (the graph budget the KV cache was sized
    around): a capture that needs more fails loudly instead of eating into the KV cache.
    A staged wake maps some chunks first and the rest later (map_chunks), possibly from
    another thread: the chunk bookkeeping is behind a lock.
    """

    def __init__(self, backend: VmmBackend, chunk_size: int, range_size: int,
                 max_physical_bytes: int | None = None) -> None:
        gran = backend.granularity()
        if chunk_size <= 0 or chunk_size % gran:
            raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of {gran}")
        if range_size <= 0 or range_size % chunk_size:
            raise ValueError(
                f"range_size {range_size} must be a positive multiple of chunk_size {chunk_size}"
            )
        self.backend = backend
        self.chunk_size = chunk_size
        self.range_size = range_size
        self.max_physical_bytes = max_physical_bytes
        self._chunks: list[Any] = []  # handles; None: not mapped (asleep, or a staged wake)
        self._lock = threading.RLock()
        self._spaces: list[_Space] = []
        self._live: dict[int, int] = {}  # address -> size, for free()
        self._released = False
        self.asleep = False

    def _check_open(self) -> None:
        if self._released:
            raise VmmError("VmmPool used after release()")

    def _check_awake(self) -> None:
        self._check_open()
        if self.asleep:
            raise VmmError("VmmPool is asleep (physical memory released); call wake_up() first")

    def new_space(self) -> int:
        """Reserve a fresh virtual range for the next capture; returns its base address."""
        self._check_awake()
        self._spaces.append(_Space(self.backend.reserve(self.range_size)))
        return self._spaces[-1].base

    def alloc(self, size: int) -> int:
        with self._lock:
            return self._alloc(size)

    def _alloc(self, size: int) -> int:
        self._check_awake()
        if size <= 0:
            raise VmmError(f"alloc size must be positive, got {size}")
        if not self._spaces:
            raise VmmError("alloc before new_space()")
        space = self._spaces[-1]
        offset = space.peak  # always a multiple of ALIGN
        end = offset + size
        need = -(-end // self.chunk_size)
        cap = self.max_physical_bytes
        if cap is not None and need * self.chunk_size > cap:
            raise VmmError(
                f"this capture needs {need * self.chunk_size} bytes of physical graph memory "
                f"({end} in use); the graph budget is {cap} bytes"
            )
        if end > self.range_size:
            raise VmmError(
                f"alloc of {size} bytes at offset {offset} exceeds the reserved "
                f"range of {self.range_size} bytes ({space.peak} in use)"
            )
        while space.mapped < need:
            i = space.mapped
            if i == len(self._chunks):
                self._chunks.append(self.backend.create_chunk(self.chunk_size))
            if self._chunks[i] is None:
                raise VmmError(f"alloc over chunk {i}, which a staged wake has not mapped yet")
            self.backend.map(space.base + i * self.chunk_size, self.chunk_size, self._chunks[i])
            space.mapped += 1
        space.peak = -(-end // ALIGN) * ALIGN
        addr = space.base + offset
        self._live[addr] = size
        return addr

    @property
    def live_allocations(self) -> int:
        """Allocations not yet freed (torch frees a pool's segments when its graphs go)."""
        return len(self._live)

    def free(self, addr: int) -> None:
        self._check_open()
        if self._live.pop(addr, None) is None:
            raise VmmError(f"free of {addr:#x}, which this pool did not allocate (or freed)")

    def tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        self._check_awake()
        return self.backend.tensor(addr, nbytes)

    @property
    def unmapped_chunks(self) -> int:
        """Chunks a staged wake has not mapped yet (all of them while asleep)."""
        return self._chunks.count(None)

    def stats(self) -> VmmStats:
        with self._lock:
            return self._stats()

    def _stats(self) -> VmmStats:
        self._check_open()
        return VmmStats(
            physical_bytes=(len(self._chunks) - self.unmapped_chunks) * self.chunk_size,
            virtual_bytes=len(self._spaces) * self.range_size,
            spaces=len(self._spaces),
            chunks=len(self._chunks),
            chunk_size=self.chunk_size,
            space_peak_bytes=[s.peak for s in self._spaces],
            asleep=self.asleep,
        )

    def _mappings(self, chunks: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """(address, chunk index) of every mapping of `chunks` (None: all), over all spaces."""
        wanted = range(len(self._chunks)) if chunks is None else chunks
        return [(s.base + i * self.chunk_size, i) for i in wanted for s in self._spaces
                if i < s.mapped]

    def sleep(self) -> None:
        """Unmap every range and release the physical chunks; the reservations stay.

        Bytes are NOT kept: after wake_up() the ranges read whatever the new chunks hold.
        Graph-private memory needs no keeping: every replay rewrites the intermediates it
        reads. The caller must make sure no kernel touches the ranges meanwhile.
        """
        with self._lock:
            self._check_awake()
            self._drop_physical()
            self.asleep = True

    def _drop_physical(self) -> None:
        """Unmap every mapped chunk (one unmap per map), then release the chunks."""
        for addr, i in self._mappings():
            if self._chunks[i] is not None:
                self.backend.unmap(addr, self.chunk_size)
        for i in reversed(range(len(self._chunks))):
            if self._chunks[i] is not None:
                self.backend.release_chunk(self._chunks[i], self.chunk_size)
                self._chunks[i] = None

    def wake_up(self, chunks: Iterable[int] | None = None) -> None:
        """Create chunks again and map them at the same addresses as before: every chunk
        (None), or only the indices in `chunks`, a staged wake's first slice (map_chunks
        maps the rest). Creation fails whole: the pool then stays asleep, holding nothing."""
        with self._lock:
            self._check_open()
            if not self.asleep:
                raise VmmError("wake_up() on a VmmPool that is not asleep")
            todo = range(len(self._chunks)) if chunks is None else sorted(set(chunks))
            try:
                for i in todo:
                    self._chunks[i] = self.backend.create_chunk(self.chunk_size)
            except BaseException:
                for i in todo:  # nothing is mapped yet
                    if self._chunks[i] is not None:
                        self.backend.release_chunk(self._chunks[i], self.chunk_size)
                        self._chunks[i] = None
                raise
            for addr, i in self._mappings(todo):
                self.backend.map(addr, self.chunk_size, self._chunks[i])
            self.asleep = False

    def map_chunks(self, chunks: Iterable[int]) -> int:
        """Create and map the chunks among `chunks` a staged wake left unmapped (a chunk
        whose creation fails stays unmapped); returns how many it mapped."""
        with self._lock:
            self._check_awake()
            done = 0
            for i in chunks:
                if self._chunks[i] is not None:
                    continue
                handle = self.backend.create_chunk(self.chunk_size)
                mapped: list[int] = []
                try:
                    for addr, _ in self._mappings([i]):
                        self.backend.map(addr, self.chunk_size, handle)
                        mapped.append(addr)
                except BaseException:
                    for addr in mapped:
                        self.backend.unmap(addr, self.chunk_size)
                    self.backend.release_chunk(handle, self.chunk_size)
                    raise
                self._chunks[i] = handle
                done += 1
            return done

    def release(self) -> None:
        """Unmap every range, free the reservations and release the physical chunks."""
        with self._lock:
            self._check_open()
            self._released = True
            self._drop_physical()  # asleep: nothing left to drop
            for space in self._spaces:
                self.backend.free_range(space.base, self.range_size)
            self._spaces.clear()
            self._chunks.clear()
            self._live.clear()
