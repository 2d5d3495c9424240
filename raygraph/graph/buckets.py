"""Capture sizes are data: one function returns the schedule, lookup is bisect."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from raygraph.config import GraphConfig, ServeConfig
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


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= n, or None above the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_schedule(decode_sizes: Sequence[int], prefill_sizes: Sequence[int]) -> list[BucketKey]:
    """Every key to capture, largest first within each phase (later graphs then fit in the
    memory the larger ones already took from the shared pool)."""
    keys = [BucketKey("decode", n) for n in sorted(decode_sizes, reverse=True)]
    keys += [BucketKey("prefill", n) for n in sorted(prefill_sizes, reverse=True)]
    return keys


def drafts_as_rows(num_tokens: int, num_seqs: int, max_rows: int | None) -> bool:
    """Whether a decode-shaped step (each sequence one token, or one and its drafts) runs
    as decode rows, a row per token: always without drafts; with them, up to `max_rows`
    rows (the largest decode bucket where speculation is configured, else 0; None: any,
    as an eager executor runs them). Past it, drafts are verified in a prefill-shaped step.
    The coordinator's keys and the workers' inputs both follow it."""
    return num_tokens == num_seqs or max_rows is None or num_tokens <= max_rows


# A DP group with nothing to run still steps, so the MoE collectives match: one padding
# token, a decode of one sequence. The coordinator keys it, the executor builds it.
IDLE_TOKENS = 1


@dataclass(frozen=True)
class BucketPlan:
    """Which key a step runs under. Pure Python, so the coordinator and every worker derive
    the same key from the same batch shape; a worker whose own key differs is a bug."""

    decode_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    max_seqs: int  # prefill batches with more sequences than the buffers hold run eagerly
    ep: bool = False  # MoE expert parallelism: keys carry the dispatch size
    # speculative decoding: decode graphs run verify chunks as rows (graph/inputs.py)
    verify: bool = False

    @staticmethod
    def from_config(cfg: GraphConfig, max_num_seqs: int, max_num_batched_tokens: int,
                    ep: bool = False, verify: bool = False) -> BucketPlan:
        decode = capture_sizes(cfg.decode_sizes, min(max_num_seqs, cfg.max_decode))
        prefill = capture_sizes(cfg.prefill_sizes, min(max_num_batched_tokens, cfg.max_prefill))
        return BucketPlan(tuple(decode), tuple(prefill), max(decode[-1], max_num_seqs), ep,
                          verify)

    @property
    def max_verify_rows(self) -> int:
        """The most decode rows a step of verify chunks runs as (drafts_as_rows); 0 without
        speculation: such a step is prefill-shaped."""
        return self.decode_sizes[-1] if self.verify else 0

    @property
    def max_size(self) -> int:
        return max(self.decode_sizes[-1], self.prefill_sizes[-1])

    def key(self, num_tokens: int, num_seqs: int, decode: bool, comm: int = 0) -> BucketKey:
        """The step's bucket; phase "eager" (num_tokens unpadded) above the largest one.

        `comm` > 0 is the EP dispatch size every rank pads to (see `comm_tokens`); it is part
        of the key, and above the largest capture size every rank runs eagerly.
        """
        decode = decode and drafts_as_rows(num_tokens, num_seqs, self.max_verify_rows)
        if decode:  # a row per token: a verifying sequence's drafts are rows too
            n = bucket(num_tokens, self.decode_sizes)
            local = BucketKey("decode", n) if n is not None else BucketKey("eager", num_tokens)
        else:
            n = bucket(num_tokens, self.prefill_sizes)
            eager = n is None or num_seqs > self.max_seqs
            local = BucketKey("eager", num_tokens) if eager else BucketKey("prefill", n)
        if comm == 0:
            return local
        if local.phase == "eager" or comm > self.max_size:
            return BucketKey("eager", num_tokens, comm)
        return BucketKey(local.phase, local.num_tokens, comm)

    def comm_tokens(self, batches: list[tuple[int, int, bool]]) -> int:
        """The EP dispatch size for one step of a DP group: the largest padded local batch
        (its real size where that rank runs eagerly). Every rank pads to it, so the MoE
        collectives match; it is itself a capture size unless some rank runs eagerly."""
        return max(self.key(t, s, d).num_tokens for t, s, d in batches)

    def allows(self, key: BucketKey) -> bool:
        """Whether `key` may be captured: a local bucket of the schedule with, under EP, a
        dispatch size between its own token count and the largest capture size."""
        local = BucketKey(key.phase, key.num_tokens)
        if local not in capture_schedule(self.decode_sizes, self.prefill_sizes):
            return False
        if not self.ep:
            return key.num_comm_tokens == 0
        return key.num_tokens <= key.num_comm_tokens <= self.max_size

    def schedule(self) -> list[BucketKey]:
        """The start-up schedule. With EP each key gets the balanced dispatch size (its own
        token count); pairs with a larger one (unbalanced DP loads) are captured when first
        seen, in lockstep, so the graphs stay bounded by |sizes| x |sizes|."""
        keys = capture_schedule(self.decode_sizes, self.prefill_sizes)
        if self.ep:
            return [BucketKey(k.phase, k.num_tokens, k.num_tokens) for k in keys]
        return keys


def bucket_plan(cfg: ServeConfig) -> BucketPlan | None:
    """The capture sizes and bucketing every rank and the coordinator share; None when
    steps run eagerly. The one place it is derived."""
    if not cfg.uses_graphs:
        return None
    s = cfg.scheduler
    return BucketPlan.from_config(cfg.graph, s.max_num_seqs, s.max_num_batched_tokens,
                                  cfg.parallel.ep > 1, cfg.speculative.method != "")
