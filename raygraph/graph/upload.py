"""Host-to-device copies on the step's critical path, as driver calls.

A block table is a [rows, max_blocks] array whose rows use a few leading columns: a
128K-context model's row is 8,192 blocks wide. Moving only the columns in use takes a
2-D copy: torch's copy_ of a strided slice of pinned memory stages through pageable
memory instead, and its dispatch costs several times a driver call's host time.
"""

from __future__ import annotations

import torch


class DriverStream:
    """The current torch stream as a driver CUstream (cached by its raw handle: building
    one per call costs host time on every step)."""

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver  # GPU-only import

        self.driver = driver
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._streams: dict[int, object] = {}

    def current(self) -> object:
        # the raw handle, as inductor's generated code reads it: a Stream object costs more
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = self.driver.CUstream(raw)
        return stream


class TableCopy:
    """Copies the first rows and columns of a pinned host table to its device twin (both
    [rows, cols] and contiguous) on the current stream: one `cuMemcpy2DAsync` on a GPU, a
    slice copy on the CPU."""

    def __init__(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        if (host.shape != dev.shape or host.dtype != dev.dtype or host.dim() != 2
                or not (host.is_contiguous() and dev.is_contiguous())):
            raise ValueError(f"tables differ or are strided: {tuple(host.shape)} "
                             f"{host.dtype} and {tuple(dev.shape)} {dev.dtype}")
        self.host, self.dev = host, dev
        self.stream = DriverStream(dev.device) if dev.is_cuda else None
        if self.stream is not None:
            driver = self.stream.driver
            copy = self._copy = driver.CUDA_MEMCPY2D()  # source and destination set once
            copy.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_HOST
            copy.srcHost = host.data_ptr()
            copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
            copy.dstDevice = dev.data_ptr()
            copy.srcPitch = copy.dstPitch = host.stride(0) * host.element_size()

    def __call__(self, rows: int, cols: int, stream: object | None = None) -> None:
        """`stream`: the current stream's CUstream where the caller has it already."""
        if not (0 <= rows <= self.host.shape[0] and 0 <= cols <= self.host.shape[1]):
            raise ValueError(f"{rows} x {cols} of a {tuple(self.host.shape)} table")
        if not (rows and cols):
            return
        if self.stream is None:
            self.dev[:rows, :cols].copy_(self.host[:rows, :cols])
            return
        driver, copy = self.stream.driver, self._copy
        copy.WidthInBytes, copy.Height = cols * self.host.element_size(), rows
        (err,) = driver.cuMemcpy2DAsync(
            copy, stream if stream is not None else self.stream.current())
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"table upload ({rows} x {cols}) failed: {err}")
