"""Capture sizes are data: one function returns the schedule, lookup is bisect."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from raygraph.config import GraphConfig
from raygraph.protocol import BucketKey


def default_capture_sizes(max_size: int) -> list[int]:
    """SGLang's schedule (4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64,
    1280..4096 step 256), plus 1 and 2 so small decode batches are not padded to 4."""
    sizes = [1, 2, *range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32),
             *range(576, 1025, 64), *range(1280, 4097, 256)]
    capped = [s for s in sizes if s <= max_size]
    if not capped or capped[-1] != max_size:
        capped.append(max_size)  # the cap itself is always a bucket
    return capped


def capture_sizes(explicit: list[int] | None, max_size: int) -> list[int]:
    if explicit is None:
        return default_capture_sizes(max_size)
    sizes = sorted(set(explicit))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"capture sizes must be positive integers, got {explicit}")
    return sizes


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest capture size >= n, or None above the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_schedule(decode_sizes: list[int], prefill_sizes: list[int]) -> list[BucketKey]:
    """Every key to capture, largest first within each phase (later graphs then fit in the
    memory the larger ones already took from the shared pool)."""
    keys = [BucketKey("decode", n) for n in sorted(decode_sizes, reverse=True)]
    keys += [BucketKey("prefill", n) for n in sorted(prefill_sizes, reverse=True)]
    return keys


@dataclass(frozen=True)
class BucketPlan:
    """Which key a step runs under. Pure Python, so the coordinator and every worker derive
    the same key from the same batch shape; a worker whose own key differs is a bug."""

    decode_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    max_seqs: int  # prefill batches with more sequences than the buffers hold run eagerly

    @staticmethod
    def from_config(cfg: GraphConfig, max_num_seqs: int, max_num_batched_tokens: int) -> BucketPlan:
        decode = capture_sizes(cfg.decode_sizes, min(max_num_seqs, cfg.max_decode))
        prefill = capture_sizes(cfg.prefill_sizes, min(max_num_batched_tokens, cfg.max_prefill))
        return BucketPlan(tuple(decode), tuple(prefill), max(decode[-1], max_num_seqs))

    def key(self, num_tokens: int, num_seqs: int, decode: bool) -> BucketKey:
        """The step's bucket; phase "eager" (num_tokens unpadded) above the largest one."""
        if decode:
            n = bucket(num_seqs, list(self.decode_sizes))
            return BucketKey("decode", n) if n is not None else BucketKey("eager", num_tokens)
        n = bucket(num_tokens, list(self.prefill_sizes))
        if n is None or num_seqs > self.max_seqs:
            return BucketKey("eager", num_tokens)
        return BucketKey("prefill", n)

    def schedule(self) -> list[BucketKey]:
        return capture_schedule(list(self.decode_sizes), list(self.prefill_sizes))
