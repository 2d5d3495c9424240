"""The KV cache's arena, which can wake in stages.

A level-1 wake cannot map a large KV cache in 100 ms: the driver scrubs the memory it hands
out at ~1.7 ms/GiB (118 GiB: ~0.2 s, bench/RESULTS.md), however many threads ask. So the
cache lives in small chunks (<= KV_CHUNK) and a staged wake maps a first slice only: the
chunks holding blocks [0, N) of every layer's K and V, and each tensor's last block (the
scratch block padding writes go to). Serving resumes with those blocks while a thread
(KVMapper) maps the other chunks in block order; `blocks_ready` says how far it got, and the
coordinator hands out no block past it, so no kernel touches a chunk that is not mapped.

Layout: the 2 x layers tensors [num_blocks + 1, block_size, Hkv, D] one after the other
(the kernels take each layer's tensors with their strides). A prefix of every tensor's
blocks costs about one chunk per tensor more than its own bytes: a tensor's scratch block
and the next tensor's first blocks mostly share a chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left

import torch

from raygraph.memory.arena import VmmArena, _round_up, tensor_bytes
from raygraph.memory.vmm import VmmBackend

log = logging.getLogger("raygraph.memory")

KV_CHUNK = 64 << 20  # llama-1b's 116 GiB on an H200: ~1850 chunks, one create + map each
MIN_CHUNKS_PER_TENSOR = 8  # a small cache (CPU tests) still wakes in stages


def chunk_needs(spans: list[tuple[int, int, int]], chunk: int, num_chunks: int) -> list[int]:
    """Per chunk, the first block it holds of any tensor, or -1 if it holds a scratch block
    (a tensor's last row: any step may write there). spans: per tensor, (offset in the
    range, rows, bytes per row)."""
    needs = [1 << 62] * num_chunks  # every chunk holds some tensor's bytes
    for start, rows, row in spans:
        end = start + rows * row
        for c in range(start // chunk, (end - 1) // chunk + 1):
            first = (max(c * chunk, start) - start) // row
            last = (min((c + 1) * chunk, end) - 1 - start) // row
            needs[c] = min(needs[c], -1 if last == rows - 1 else first)
    return needs


class KVArena(VmmArena):
    """A VmmArena of KV tensors whose chunks wake in block order (see the module doc)."""

    def __init__(self, backend: VmmBackend, shape: tuple[int, ...], dtype: torch.dtype,
                 layers: int) -> None:
        per_tensor = tensor_bytes(shape, dtype)
        gran = backend.granularity()
        chunk = min(_round_up(KV_CHUNK, gran),
                    _round_up(-(-per_tensor // MIN_CHUNKS_PER_TENSOR), gran))
        super().__init__(backend, 2 * layers * per_tensor, keep=False, chunk=chunk)
        self.num_blocks = shape[0] - 1  # the last row of each tensor: the scratch block
        self.bytes_per_block = 0  # over every tensor; set by _plan
        self._order: list[int] = []  # chunk indices, in the order a staged wake maps them
        self._needs: list[int] = []  # per position in _order: the first block it holds
        self._mapped = 0  # chunks of _order mapped; the rest wait for map_next()

    def _plan(self, tensors: list[torch.Tensor]) -> None:
        """Order the chunks by the first block each holds, scratch blocks first."""
        spans = [(t.data_ptr() - self.base, t.shape[0], t.stride(0) * t.element_size())
                 for t in tensors]
        needs = chunk_needs(spans, self.pool.chunk_size, self.stats().chunks)
        self._order = sorted(range(len(needs)), key=needs.__getitem__)
        self._needs = [needs[c] for c in self._order]
        self._mapped = len(self._order)
        self.bytes_per_block = sum(row for _, _, row in spans)

    @property
    def blocks_ready(self) -> int:
        """n: blocks [0, n) of every tensor and every scratch block are mapped."""
        if self.asleep:
            return 0
        k = self._mapped
        if k == len(self._order):
            return self.num_blocks
        return max(0, min(self._needs[k], self.num_blocks))

    @property
    def chunks_left(self) -> int:
        return 0 if self.asleep else len(self._order) - self._mapped

    def wake_up(self, first_blocks: int | None = None) -> int:
        """Map every chunk (None), or a staged wake's first slice: the chunks holding blocks
        [0, first_blocks) (at least block 0) and the scratch blocks; map_next() maps the
        rest. Returns the bytes mapped now."""
        if first_blocks is None:
            self.pool.wake_up()
            self._mapped = len(self._order)
        else:
            k = bisect_left(self._needs, max(1, first_blocks))
            self.pool.wake_up(self._order[:k])
            self._mapped = k
        return self.stats().physical_bytes

    def map_next(self) -> bool:
        """Map the next chunk of a staged wake; False once every chunk is mapped."""
        k = self._mapped
        if k == len(self._order):
            return False
        self.pool.map_chunks([self._order[k]])
        self._mapped = k + 1
        return k + 1 < len(self._order)


def kv_arena(backend: VmmBackend, shape: tuple[int, ...], dtype: torch.dtype,
             layers: int) -> tuple[KVArena, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One (k_cache, v_cache) pair per layer, zero-filled (once, here), in an arena that
    drops them at sleep."""
    arena = KVArena(backend, shape, dtype, layers)
    pairs = [(arena.tensor(shape, dtype), arena.tensor(shape, dtype)) for _ in range(layers)]
    arena._bytes().zero_()
    arena._plan([t for pair in pairs for t in pair])
    return arena, pairs


class KVMapper:
    """Maps what a staged wake left, chunk by chunk, on a thread of its own while steps run.
    A failure (no device memory) is kept in `error` for the next progress call."""

    def __init__(self, arena: KVArena, device: torch.device, rank: int) -> None:
        self.arena = arena
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(device, rank), daemon=True,
                                        name=f"raygraph-kv-map-{rank}")
        self._thread.start()

    def _run(self, device: torch.device, rank: int) -> None:
        t0, chunks = time.perf_counter(), self.arena.chunks_left
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the driver calls want its context current
            while not self._stop.is_set() and self.arena.map_next():
                pass
        except BaseException as e:  # noqa: BLE001 - reported by the next progress call
            log.error("rank %d: mapping the rest of the KV cache failed at %d of %d blocks: "
                      "%s", rank, self.arena.blocks_ready, self.arena.num_blocks, e)
            self.error = e
            return
        if not self._stop.is_set():
            log.info("rank %d: the rest of the KV cache mapped in the background: %d chunks "
                     "in %.3fs", rank, chunks, time.perf_counter() - t0)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the chunk being mapped (a sleep must not race the mapping)."""
        self._stop.set()
        self._thread.join()
