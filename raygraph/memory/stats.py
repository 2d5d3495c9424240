"""Memory figures a worker reports (msgspec Structs: they cross the actor boundary)."""

from __future__ import annotations

import msgspec


class VmmStats(msgspec.Struct, frozen=True):
    """A VMM pool's mappings (memory/vmm.VmmPool.stats)."""

    physical_bytes: int
    virtual_bytes: int
    spaces: int
    chunks: int
    chunk_size: int
    space_peak_bytes: list[int]  # per space, in creation order
    asleep: bool = False  # physical chunks released; physical_bytes is then 0


class GraphPoolStats(msgspec.Struct, frozen=True):
    """held_bytes: device memory the captured graphs hold (VMM: physical chunks).
    capture_bytes: per bucket key, what that capture's graphs hold on their own (VMM: its
    range's peak; torch shared pool: what the capture added to the pool)."""

    kind: str
    held_bytes: int
    capture_bytes: dict[str, int]
    virtual_bytes: int = 0
    spaces: int = 0
    chunks: int = 0
    chunk_size: int = 0
    budget_bytes: int | None = None  # the cap the KV cache was sized around (VMM only)
    asleep: bool = False


class MemoryStats(msgspec.Struct, frozen=True):
    rank: int
    device: str
    weight_bytes: int
    kv_cache_bytes: int
    input_buffer_bytes: int  # the persistent buffers all graphs read (one set, max shape)
    graph: GraphPoolStats | None  # None: nothing captured on this device (eager, CPU)
    sleep_level: int = 0  # 0 awake; 1: graph pool and KV cache released; 2: weights too
    kv_cache_vmm: VmmStats | None = None  # the KV cache's arena (None: not on VMM memory)
    weight_vmm: VmmStats | None = None  # the weights' arena (None: offloaded, or no VMM)


class SleepStats(msgspec.Struct, frozen=True):
    """What one rank released (sleep) or mapped again (wake_up), in bytes, and how long it
    took there. kv_blocks_ready (wake_up): the KV blocks usable when it returned; a staged
    wake maps the rest in the background (Worker.kv_blocks_ready)."""

    rank: int
    level: int
    graph_bytes: int
    kv_cache_bytes: int
    weight_bytes: int
    seconds: float
    kv_blocks_ready: int = 0

    @property
    def total_bytes(self) -> int:
        return self.graph_bytes + self.kv_cache_bytes + self.weight_bytes


class KVMapError(RuntimeError):
    """A staged wake could not map the rest of the KV cache (no device memory): the blocks
    mapped before it stay usable; a sleep and wake maps the whole cache again."""
