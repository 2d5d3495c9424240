"""KV page pool bookkeeping: fixed-size blocks, a free list and per-block refcounts.

Pure Python: the scheduler owns one and the workers only see block ids in StepPlans.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def utilization(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
