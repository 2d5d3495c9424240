"""VMM pool over the CUDA driver: two ranges alias one set of physical chunks."""

from __future__ import annotations

import pytest
import torch

from raygraph.memory.vmm import CudaBackend, VmmError, VmmPool

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_cuda_spaces_alias_and_release_frees() -> None:
    backend = CudaBackend(0)
    chunk = backend.granularity() * max(1, (64 * MiB) // backend.granularity())
    pool = VmmPool(backend, chunk, 8 * chunk)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()

    pool.new_space()
    a = pool.alloc(3 * chunk)
    pool.new_space()
    b = pool.alloc(2 * chunk)
    ta = pool.tensor(a, 3 * chunk)
    tb = pool.tensor(b, 2 * chunk)
    assert ta.is_cuda and ta.data_ptr() == a and tb.data_ptr() == b

    for i in range(3):  # a different byte in each chunk, so a mis-mapped chunk shows
        ta[i * chunk : (i + 1) * chunk] = 10 + i
    torch.cuda.synchronize()
    for i in range(2):
        assert torch.all(tb[i * chunk : (i + 1) * chunk] == 10 + i)
    tb[chunk + 5] = 77
    torch.cuda.synchronize()
    assert int(ta[chunk + 5]) == 77

    s = pool.stats()
    assert (s.chunks, s.physical_bytes, s.virtual_bytes) == (3, 3 * chunk, 16 * chunk)
    assert s.space_peak_bytes == [3 * chunk, 2 * chunk]
    free_mapped, _ = torch.cuda.mem_get_info()
    assert free_before - free_mapped >= 3 * chunk

    del ta, tb
    pool.release()
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after - free_mapped >= 3 * chunk
    with pytest.raises(VmmError, match="after release"):
        pool.alloc(1)
