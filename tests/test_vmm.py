"""VMM pool bookkeeping over the memfd backend: real double mapping on a CPU-only Linux box."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from raygraph.memory.vmm import ALIGN, MemfdBackend, VmmError, VmmPool, VmmStats

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd is Linux")

CHUNK = 4 * mmap.PAGESIZE
RANGE = 16 * CHUNK


@pytest.fixture
def pool():
    backend = MemfdBackend()
    p = VmmPool(backend, CHUNK, RANGE)
    yield p
    if not p._released:
        p.release()
    backend.close()


def test_spaces_alias_the_same_physical_bytes(pool: VmmPool) -> None:
    pool.new_space()
    a = pool.alloc(3 * CHUNK)
    pool.new_space()
    b = pool.alloc(3 * CHUNK)
    assert a != b
    ta, tb = pool.tensor(a, 3 * CHUNK), pool.tensor(b, 3 * CHUNK)
    for i in range(3):  # a different byte in each chunk, so a mis-mapped chunk shows
        ta[i * CHUNK : (i + 1) * CHUNK] = 10 + i
    for i in range(3):
        assert torch.all(tb[i * CHUNK : (i + 1) * CHUNK] == 10 + i)
    tb[CHUNK + 7] = 201
    assert int(ta[CHUNK + 7]) == 201
    # a 3rd space sees the bytes too, through a view at a different offset into its range
    pool.new_space()
    pool.alloc(ALIGN)
    c = pool.alloc(2 * CHUNK)
    assert c - pool._spaces[-1].base == ALIGN
    assert int(pool.tensor(c, 2 * CHUNK)[CHUNK + 7 - ALIGN]) == 201


def test_physical_is_max_of_spaces_virtual_is_sum(pool: VmmPool) -> None:
    for n in (3, 10, 5):
        pool.new_space()
        pool.alloc(n * CHUNK)
    s = pool.stats()
    assert s == VmmStats(
        physical_bytes=10 * CHUNK,
        virtual_bytes=3 * RANGE,
        spaces=3,
        chunks=10,
        chunk_size=CHUNK,
        space_peak_bytes=[3 * CHUNK, 10 * CHUNK, 5 * CHUNK],
    )
    assert pool.backend.file_bytes() == 10 * CHUNK


def test_chunks_created_only_when_a_space_outgrows_all_before(pool: VmmPool) -> None:
    created = []
    real = pool.backend.create_chunk
    pool.backend.create_chunk = lambda size: created.append(size) or real(size)
    pool.new_space()
    pool.alloc(100)
    assert len(created) == 1
    pool.alloc(CHUNK - 2 * ALIGN)  # still inside chunk 0 after alignment
    assert len(created) == 1
    pool.alloc(CHUNK)  # crosses into chunk 1
    assert len(created) == 2
    pool.new_space()
    pool.alloc(2 * CHUNK)  # reuses chunks 0 and 1
    assert len(created) == 2
    pool.alloc(ALIGN)  # 2 * CHUNK + ALIGN: needs chunk 2
    assert len(created) == 3 and pool.stats().chunks == 3


def test_bump_alignment_and_exact_peaks(pool: VmmPool) -> None:
    base = pool.new_space()
    assert pool.alloc(1) == base
    assert pool.alloc(ALIGN + 1) == base + ALIGN
    assert pool.alloc(10) == base + 3 * ALIGN
    assert pool.stats().space_peak_bytes == [4 * ALIGN]
    base2 = pool.new_space()
    assert pool.alloc(5) == base2  # the bump pointer starts over in a new space
    assert pool.stats().space_peak_bytes == [4 * ALIGN, ALIGN]
    assert pool.stats().physical_bytes == CHUNK


def test_alloc_beyond_range_raises_and_leaves_state(pool: VmmPool) -> None:
    pool.new_space()
    pool.alloc(RANGE - ALIGN)
    before = pool.stats()
    with pytest.raises(VmmError, match=f"exceeds the reserved range of {RANGE} bytes"):
        pool.alloc(ALIGN + 1)
    assert pool.stats() == before
    pool.alloc(ALIGN)  # exactly fills the range
    with pytest.raises(VmmError, match="exceeds"):
        pool.alloc(1)


def test_free_rejects_unknown_and_double_free(pool: VmmPool) -> None:
    pool.new_space()
    a = pool.alloc(64)
    with pytest.raises(VmmError, match="did not allocate"):
        pool.free(a + 1)
    pool.free(a)
    with pytest.raises(VmmError):
        pool.free(a)
    assert pool.stats().space_peak_bytes == [ALIGN]  # free gives nothing back mid-capture


def test_alloc_needs_a_space_and_a_positive_size(pool: VmmPool) -> None:
    with pytest.raises(VmmError, match="new_space"):
        pool.alloc(10)
    pool.new_space()
    with pytest.raises(VmmError, match="positive"):
        pool.alloc(0)


def test_release_frees_everything_and_forbids_use(pool: VmmPool) -> None:
    for n in (2, 4):
        pool.new_space()
        pool.alloc(n * CHUNK)
    assert pool.backend.file_bytes() == 4 * CHUNK
    pool.release()
    assert pool.backend.file_bytes() == 0
    assert pool.backend._live == {}
    for call in (
        pool.new_space,
        lambda: pool.alloc(1),
        lambda: pool.free(0),
        pool.stats,
        pool.release,
    ):
        with pytest.raises(VmmError, match="after release"):
            call()


def test_release_unmaps_the_ranges(pool: VmmPool) -> None:
    pool.new_space()
    a = pool.alloc(CHUNK)
    maps = open("/proc/self/maps").read()
    assert f"{a:x}-" in maps and "raygraph-vmm" in maps
    pool.release()
    maps = open("/proc/self/maps").read()
    assert f"{a:x}-" not in maps and "raygraph-vmm" not in maps


def test_bad_geometry_is_rejected() -> None:
    backend = MemfdBackend()
    try:
        with pytest.raises(ValueError, match="chunk_size"):
            VmmPool(backend, CHUNK + 1, RANGE)
        with pytest.raises(ValueError, match="range_size"):
            VmmPool(backend, CHUNK, RANGE + mmap.PAGESIZE)
    finally:
        backend.close()
