"""What a worker releases when it sleeps, and maps again when it wakes.

Level 1: the executor's graph pool and the KV cache (its contents are dropped: the
coordinator drained the requests and empties its prefix cache). Level 2: the weights too
(kept in host memory). Both live in VMM arenas (memory/arena.py), so wake maps memory at the
same addresses the captured graphs hold: no recapture. The eager executor sleeps too; it has
no graph pool. A staged wake (CacheConfig.staged_wake) maps only the KV cache's first blocks
before it returns and the rest on a thread meanwhile (memory/kv_arena.py).

A drafter (speculative decoding with a draft model or an EAGLE-3 head) sleeps alongside: its
KV cache and weights live in arenas of their own (its cache is mapped whole at wake), and
its few small graphs, in a torch pool that cannot unmap, are dropped at sleep and captured
again at wake.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from raygraph.config import CacheConfig
from raygraph.graph.executor import Executor
from raygraph.memory.arena import VmmArena, move_parameters, vmm_backend
from raygraph.memory.kv_arena import KVArena, KVMapper, kv_arena
from raygraph.memory.stats import KVMapError, SleepStats
from raygraph.worker.drafter import Drafter
from raygraph.worker.state import StateError


class SleepMemory:
    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.weights: VmmArena | None = None  # None: offloaded weights (or no VMM backend)
        self.kv: KVArena | None = None
        self.num_kv_blocks = 0  # usable blocks (the scratch block aside), VMM or not
        self.level = 0  # 0 awake
        self._mapper: KVMapper | None = None  # a staged wake's background mapping
        self.drafter: Drafter | None = None
        self.draft_weights: VmmArena | None = None
        self.draft_kv: KVArena | None = None

    def take_weights(self, model: nn.Module) -> None:
        """Move the model's parameters into an arena (before any capture)."""
        backend = vmm_backend(self.device)
        if backend is not None:
            self.weights = move_parameters(model, backend)

    def take_drafter(self, drafter: Drafter, target: nn.Module) -> None:
        """Move the drafter's parameters into an arena of their own (one it shares with the
        target, an EAGLE-3 head's embedding, stays in the target's), before any capture."""
        self.drafter = drafter
        backend = vmm_backend(self.device)
        if backend is not None and self.weights is not None:
            self.draft_weights = move_parameters(drafter.model, backend, skip=target)

    def draft_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The drafter's zeroed (k_cache, v_cache) per layer beside the target's `num_blocks`,
        in an arena (None: no VMM backend here)."""
        backend = vmm_backend(self.device)
        if backend is None:
            return None
        d = self.drafter
        self.draft_kv, pairs = kv_arena(backend, d.kv_shape(num_blocks), d.dtype,
                                        len(d.model.attention_layers()))
        return pairs

    def kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype,
                 layers: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Zeroed (k_cache, v_cache) per layer in an arena (None: no VMM backend here)."""
        self.num_kv_blocks = shape[0] - 1
        backend = vmm_backend(self.device)
        if backend is None:
            return None
        self.kv, pairs = kv_arena(backend, shape, dtype, layers)
        return pairs

    def check_awake(self) -> None:
        """Nothing may touch the released memory: a step there would fault the device."""
        if self.level:
            raise StateError(f"rank {self.rank}: asleep (level {self.level}); wake_up() first")

    def sleep(self, level: int, executor: Executor) -> SleepStats:
        """Release this rank's memory at `level`; refuses before releasing anything."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self.check_awake()
        if self.kv is None:
            raise RuntimeError(f"rank {self.rank}: the KV cache is not on VMM memory "
                               f"({self.device}); sleep needs CUDA or a Linux memfd")
        if level == 2 and self.weights is None:
            raise RuntimeError(f"rank {self.rank}: sleep level 2 needs the weights on VMM "
                               "memory; with weight offload (offload.budget_bytes) the "
                               "offload engine owns them: use level 1")
        self._stop_mapping()  # a staged wake still mapping: no race over the arena
        t0 = self._sync()
        try:
            graph = executor.sleep()  # first: a pool that cannot sleep refuses here
            kv = self.kv.sleep()
            weights = self.weights.sleep() if level == 2 else 0
            if self.drafter is not None:
                graph += self.drafter.release_graphs()
                kv += self.draft_kv.sleep() if self.draft_kv is not None else 0
                if level == 2 and self.draft_weights is not None:
                    weights += self.draft_weights.sleep()
        except BaseException:
            self.level = level
            self.wake_up(executor)  # what was released comes back; the rank serves on
            raise
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what eager steps left cached goes back too
        self.level = level
        return SleepStats(self.rank, level, graph, kv, weights, time.perf_counter() - t0)

    def wake_up(self, executor: Executor, cache: CacheConfig | None = None) -> SleepStats:
        """Map whatever sleeps again, at the same addresses; an awake rank does nothing (and
        reports the KV blocks ready). With `cache.staged_wake`, only the KV blocks of about
        `cache.wake_first_bytes` are mapped before it returns; a thread maps the rest. After
        a failure (no device memory) it may be called again."""
        t0 = time.perf_counter()
        level = self.level
        if not level:
            return SleepStats(self.rank, 0, 0, 0, 0, 0.0, self._blocks_ready())
        first = None
        if cache is not None and cache.staged_wake:
            first = max(1, cache.wake_first_bytes // self.kv.bytes_per_block)
        weights = _wake(self.weights)
        kv = self.kv.wake_up(first) if self.kv.asleep else 0
        graph = executor.wake_up()
        if self.drafter is not None:
            weights += _wake(self.draft_weights)
            kv += _wake(self.draft_kv)
            graph += self._recapture_drafter(executor)
        self._sync()
        self.level = 0
        if self.kv.chunks_left:
            self._mapper = KVMapper(self.kv, self.device, self.rank)
        return SleepStats(self.rank, level, graph, kv, weights, time.perf_counter() - t0,
                          self.kv.blocks_ready)

    def kv_blocks_ready(self) -> int:
        """n: KV blocks [0, n) are mapped (all of them, unless a staged wake is still
        mapping; 0 asleep). Raises KVMapError once the background mapping failed, until
        the next sleep."""
        m = self._mapper
        if m is not None and not m.running:  # done, or failed (error is set before it ends)
            if m.error is not None:
                raise KVMapError(f"rank {self.rank}: mapping the KV cache after wake failed "
                                 f"at {self.kv.blocks_ready} of {self.kv.num_blocks} blocks: "
                                 f"{type(m.error).__name__}: {m.error}") from m.error
            self._mapper = None
        return self._blocks_ready()

    def _blocks_ready(self) -> int:
        return self.kv.blocks_ready if self.kv is not None else self.num_kv_blocks

    def _stop_mapping(self) -> None:
        if self._mapper is not None:
            self._mapper.stop()
            self._mapper = None

    def _recapture_drafter(self, executor: Executor) -> int:
        """The drafter's graphs captured again; the bytes their pool took."""
        if not self.drafter.graphed:
            return 0
        before = torch.cuda.memory_reserved(self.device)
        self.drafter.capture_all(executor.prev_tokens)
        return max(0, torch.cuda.memory_reserved(self.device) - before)

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def stats(self) -> dict:
        """MemoryStats fields: the level and both arenas' figures."""
        return {"sleep_level": self.level,
                "kv_cache_vmm": self.kv.stats() if self.kv is not None else None,
                "weight_vmm": self.weights.stats() if self.weights is not None else None}


def _wake(arena: VmmArena | None) -> int:
    return arena.wake_up() if arena is not None and arena.asleep else 0
