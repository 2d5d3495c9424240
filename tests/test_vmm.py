"""VMM pool bookkeeping over the memfd backend: real double mapping on a CPU-only Linux box."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from raygraph.memory.stats import VmmStats
from raygraph.memory.vmm import ALIGN, MemfdBackend, VmmError, VmmPool

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
    """This pool's memfd (by inode: other tests' arenas may map memfds of the same name in
    this process) and its range are gone from the process's mappings after release."""
    inode = str(os.fstat(pool.backend.fd).st_ino)

    def mine() -> list[str]:
        return [line for line in open("/proc/self/maps").read().splitlines()
                if "raygraph-vmm" in line and line.split()[4] == inode]

    pool.new_space()
    a = pool.alloc(CHUNK)
    assert any(line.startswith(f"{a:x}-") for line in mine())
    pool.release()
    assert mine() == []


def test_bad_geometry_is_rejected() -> None:
    backend = MemfdBackend()
    try:
        with pytest.raises(ValueError, match="chunk_size"):
            VmmPool(backend, CHUNK + 1, RANGE)
        with pytest.raises(ValueError, match="range_size"):
            VmmPool(backend, CHUNK, RANGE + mmap.PAGESIZE)
    finally:
        backend.close()


def test_sleep_releases_chunks_and_wake_maps_new_ones_at_the_same_addresses(
    pool: VmmPool,
) -> None:
    bases = []
    for n in (3, 2):
        bases.append(pool.new_space())
        pool.alloc(n * CHUNK)
    pool.tensor(bases[0], 3 * CHUNK).fill_(5)
    awake = pool.stats()
    pool.sleep()
    assert pool.backend.file_bytes() == 0 and pool.backend._live == {}
    s = pool.stats()
    assert (s.asleep, s.physical_bytes, s.chunks, s.spaces) == (True, 0, 3, 2)
    # no mapping of this pool's memfd is left (other pools in the process may still map
    # theirs: match this file's inode), while the reservations stay
    inode = f" {os.fstat(pool.backend.fd).st_ino} "
    maps = open("/proc/self/maps").read()
    assert not [ln for ln in maps.splitlines() if "raygraph-vmm" in ln and inode in ln]
    spans = [tuple(int(x, 16) for x in ln.split()[0].split("-")) for ln in maps.splitlines()]
    assert any(lo <= bases[0] < hi for lo, hi in spans)  # (neighbouring VMAs may merge)
    for call in (pool.new_space, lambda: pool.alloc(1), lambda: pool.tensor(bases[0], 1),
                 pool.sleep):
        with pytest.raises(VmmError, match="asleep"):
            call()
    pool.wake_up()
    assert pool.stats() == awake and pool.backend.file_bytes() == 3 * CHUNK
    assert [sp.base for sp in pool._spaces] == bases
    ta, tb = pool.tensor(bases[0], 3 * CHUNK), pool.tensor(bases[1], 2 * CHUNK)
    assert torch.all(ta == 0)  # contents are not kept across sleep: fresh chunks
    ta[:] = torch.arange(3 * CHUNK, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(tb, ta[: 2 * CHUNK])
    with pytest.raises(VmmError, match="not asleep"):
        pool.wake_up()
    pool.new_space()  # captures go on after wake, on the same chunks
    pool.alloc(4 * CHUNK)
    assert pool.stats().chunks == 4


def test_release_while_asleep_frees_the_reservations(pool: VmmPool) -> None:
    base = pool.new_space()
    pool.alloc(CHUNK)
    pool.sleep()
    pool.release()
    assert f"{base:x}-" not in open("/proc/self/maps").read()
    with pytest.raises(VmmError, match="after release"):
        pool.wake_up()


def test_budget_caps_physical_memory_loudly() -> None:
    backend = MemfdBackend()
    pool = VmmPool(backend, CHUNK, RANGE, max_physical_bytes=3 * CHUNK)
    try:
        pool.new_space()
        pool.alloc(3 * CHUNK)  # exactly the budget
        pool.new_space()
        pool.alloc(2 * CHUNK)
        before = pool.stats()
        with pytest.raises(VmmError, match=f"needs {4 * CHUNK} bytes .* budget is {3 * CHUNK}"):
            pool.alloc(CHUNK + 1)
        assert pool.stats() == before and backend.file_bytes() == 3 * CHUNK
    finally:
        pool.release()
        backend.close()


def test_allocator_callbacks_bridge_to_the_pool(pool: VmmPool) -> None:
    """torch calls these C function pointers; here ctypes calls them the same way."""
    from raygraph.memory.vmm_allocator import ALLOC_FN, FREE_FN, VmmAllocator

    a = VmmAllocator(pool)
    alloc, free = ALLOC_FN(a.alloc_ptr), FREE_FN(a.free_ptr)
    assert alloc(100, 0, None) is None  # no space yet: NULL, error kept for the capture
    assert isinstance(a.error, VmmError) and "new_space" in str(a.error)
    base = pool.new_space()
    p1, p2 = alloc(3000, 0, None), alloc(ALIGN, 0, None)
    assert (p1, p2) == (base, base + 3072)
    free(p1, 3000, 0, None)
    assert list(pool._live) == [p2]
    pool.release()
    free(p2, ALIGN, 0, None)  # torch dropping a pool after release: ignored


def test_graph_pool_config_cli_and_cpu_worker(tiny_llama) -> None:
    import argparse

    import msgspec

    from raygraph.cli import add_serve_args, serve_config
    from raygraph.config import CacheConfig, ConfigError, GraphConfig, ServeConfig
    from raygraph.graph.executor import make_graph_pool
    from raygraph.worker.worker import Worker

    assert GraphConfig().pool == "vmm"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"pool": "bogus"}, GraphConfig)
    with pytest.raises(ConfigError, match="vmm_chunk_bytes"):
        GraphConfig(vmm_chunk_bytes=0)
    with pytest.raises(ValueError, match="unknown graph pool"):
        make_graph_pool("bogus", torch.device("cpu"), 1)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert serve_config(p.parse_args(["--graph-pool", "torch"])).graph.pool == "torch"
    assert serve_config(p.parse_args([])).graph.pool == "vmm"

    w = Worker(ServeConfig(model=str(tiny_llama), device="cpu",
                           cache=CacheConfig(num_blocks=8)), 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(8)
    s = w.memory_stats()
    assert s.graph is None and s.kv_cache_bytes == 8 * w.kv_bytes_per_block()
    assert s.input_buffer_bytes == w.executor.input_buffer_bytes > 0
    assert s.weight_bytes == sum(t.numel() * t.element_size() for t in w.model.parameters())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=type(s)) == s
    # no graph pool on a CPU: sleep releases the KV cache (and weights) alone
    assert w.sleep().graph_bytes == 0 and w.memory_stats().kv_cache_vmm.physical_bytes == 0
    w.wake_up()
