"""One request's sequence as the engine tracks it: tokens, blocks, stop state. Pure
Python data that the scheduler (engine/scheduler.py) and its KV blocks (engine/kv_cache.py)
both read and write, so it lives below them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raygraph.protocol import FinishReason, SamplingParams, TokenLogprobs


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens sent for computing (their KV is, or will be, cached)
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # sampled on the workers, not known here yet: 1 after a step's tokens are applied, 2
    # between scheduling the next step and applying this one's
    num_pending: int = 0
    sent_blocks: int = 0  # blocks of block_table the workers have
    tracked: bool = False  # the workers keep its state
    watch: bool = True  # its client wants each token as it comes (a stream, stop strings)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output, when asked for
    scheduled_at: float = 0.0  # perf_counter when first admitted (its queue time ends)
    # prefix caching (engine/kv_cache.py): keys of its known full blocks (a hash chain, kept
    # across preemption), how many leading blocks of block_table are keyed, and the tokens
    # found cached at its last admission
    block_hashes: list[int] = field(default_factory=list)
    num_keyed: int = 0
    num_cached_tokens: int = 0
    adapter_id: int = 0  # part of every block's key (0: the base model)
    lora_slot: int = -1  # the workers' adapter slot holding it (-1: the base model)
    guide: Any = None  # its grammar's matcher (raygraph/grammar.Guide): structured output
    # speculative decoding: where its drafts come from (engine/ngram.NgramIndex, or
    # engine/drafts.ModelDrafts: the workers' draft model); None: it decodes as usual
    proposer: Any = None
    drafts: int = 0  # draft tokens in its verify step in flight
    forget: int = 0  # drafts its last verify step did not keep: its next chunk says so
    spec_drafts: int = 0  # drafts proposed, and of them kept (it stops speculating when few
    spec_kept: int = 0  # hold)
    spec_misses: int = 0  # steps in a row its index proposed nothing

    @property
    def token_ids(self) -> list[int]:
        """The known tokens (a pending one is not among them)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """token_ids[start:start + n] without building the whole list (hot path: decode)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        head = self.prompt_token_ids[start : start + n]
        return head + self.output_token_ids[: max(0, start + n - p)]

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the pending one."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending
