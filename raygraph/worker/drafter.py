"""A draft model on the worker (speculative method "draft"): a small model of the target's
tokenizer that proposes each speculating sequence's next k tokens, greedily, in the same
step in which the target computed the token before them.

Its KV cache shares the target's block tables: the draft model runs over every token the
target computes (prompt chunks, decodes and verified drafts alike: `catch_up`), so a block
holds the draft model's keys for the same tokens as the target's, through prefix-cache hits
and preemption. A proposal then decodes k tokens from each asking sequence's newest token
(`propose`): which drafts the target kept, and so where the newest token sits, is read on
the device, with no host sync. Where a proposal runs past a sequence's blocks it writes into
lookahead blocks of its own, which nothing reads after that proposal (the verify step
recomputes those positions). Only the rank that samples drafts: its proposals return with
the step's tokens.
"""

from __future__ import annotations

import torch

from raygraph.config import ModelConfig, ServeConfig
from raygraph.graph.executor import EagerExecutor
from raygraph.graph.inputs import host_inputs
from raygraph.model import ops
from raygraph.model.context import AttentionMetadata, ForwardContext, forward_context
from raygraph.model.loader import build_model
from raygraph.model.parallel import Comm
from raygraph.protocol import SeqChunk, StepPlan


class Drafter:
    """The draft model, its KV cache and its proposal loop (eager)."""

    def __init__(self, cfg: ServeConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model_cfg = model_cfg
        self.k = cfg.speculative.num_speculative_tokens
        self.block_size = cfg.cache.block_size
        self.max_seqs = cfg.scheduler.max_num_seqs
        self.device, self.dtype = device, dtype
        # replicated on every drafting rank: no TP group
        self.model = build_model(model_cfg, Comm(), dtype, device,
                                 load_format=cfg.load_format)
        self.eager = EagerExecutor(self.model, self.block_size)
        self.lookahead = -(-self.k // self.block_size) + 1  # blocks a proposal may pass a table
        self.first_lookahead = 0  # set by bind_kv: the lookahead blocks follow the shared ones
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def bytes_per_block(self) -> int:
        m = self.model_cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    def bind_kv(self, num_blocks: int) -> int:
        """A cache of the target's `num_blocks` (and its scratch block), then the lookahead
        blocks; returns its bytes."""
        m = self.model_cfg
        self.first_lookahead = num_blocks + 1
        total = self.first_lookahead + self.max_seqs * self.lookahead
        shape = (total, self.block_size, m.num_kv_heads, m.head_dim)
        for layer in self.model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return total * self.bytes_per_block()

    def catch_up(self, plan: StepPlan, prev_tokens: torch.Tensor) -> None:
        """The draft model's K/V for every token of the target's step. `prev_tokens`: the
        buffer the step's fed tokens read (read before this step's samples overwrite it)."""
        if plan.seqs:
            self.eager.prev_tokens = prev_tokens
            self.eager.forward(host_inputs(plan, self.block_size))

    @torch.inference_mode()
    def propose(self, chunks: list[SeqChunk], tokens: torch.Tensor,
                targets: torch.Tensor | None) -> torch.Tensor | None:
        """[D, k] greedy drafts after the newest token of each chunk that asks for them
        (`SeqChunk.propose`), in order; None when none asks. `chunks`: the step's sampling
        chunks; `tokens` [S]: their sampled tokens; `targets`: the target's token at every
        logits row where a chunk verified drafts (worker/speculative.py), else None."""
        asks = [i for i, c in enumerate(chunks) if c.propose]
        if not asks:
            return None
        newest, pos = self._newest(chunks, asks, tokens, targets)
        d, bs, dev = len(asks), self.block_size, self.device
        width = max(len(chunks[i].block_table) for i in asks) + self.lookahead
        scratch = self.first_lookahead - 1  # the target's scratch block: never read
        tables = []
        for j, i in enumerate(asks):  # past its blocks, a sequence's own lookahead blocks
            t = chunks[i].block_table
            first = self.first_lookahead + j * self.lookahead
            tables.append(t + list(range(first, first + self.lookahead))
                          + [scratch] * (width - len(t) - self.lookahead))
        table = torch.tensor(tables, dtype=torch.int32).to(dev)
        rows = torch.arange(d, device=dev)
        starts = torch.arange(d + 1, dtype=torch.int32, device=dev)
        last = self.model_cfg.max_position_embeddings - 1
        x, out = newest, []
        for step in range(self.k):
            p = (pos + step).clamp(max=last)  # past the context: a draft never verified
            slots = table[rows, p // bs].long() * bs + p % bs
            md = AttentionMetadata(slots, table, (p + 1).int(), starts, p, rows,
                                   torch.zeros_like(rows), d, 1, width * bs, decode=True)
            with forward_context(ForwardContext(md)):
                hidden = self.model(x, p)
            x = ops.argmax(self.model.compute_logits(hidden).float())
            out.append(x)
        return torch.stack(out, 1)

    def _newest(self, chunks: list[SeqChunk], asks: list[int], tokens: torch.Tensor,
                targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, position) [D] of each asking chunk's newest token: its sampled token after
        its last one, or after a verify chunk's kept drafts the target's token there (as
        speculative.emitted reads them on the host)."""
        dev = self.device
        ask = torch.tensor(asks, device=dev)
        newest = tokens[ask]
        # a verify chunk's tokens: its last known one, then its drafts
        first = [chunks[i].start_pos + len(chunks[i].token_ids) - chunks[i].verify for i in asks]
        pos = torch.tensor(first, device=dev)
        if targets is None:
            return newest, pos
        rows, row = [], 0
        for c in chunks:
            rows.append(row)
            row += 1 + c.verify
        k = max(chunks[i].verify for i in asks)
        if k == 0:
            return newest, pos
        drafts = [chunks[i].token_ids[len(chunks[i].token_ids) - chunks[i].verify:] for i in asks]
        drafts_t = torch.tensor([x + [-1] * (k - len(x)) for x in drafts], device=dev)
        start = torch.tensor([rows[i] for i in asks], device=dev)
        at = (start.unsqueeze(1) + torch.arange(k, device=dev)).clamp(max=len(targets) - 1)
        kept = (drafts_t == targets[at]).long().cumprod(1).sum(1)  # padding -1 never matches
        verifies = torch.tensor([chunks[i].verify > 0 for i in asks], device=dev)
        newest = torch.where(verifies, targets[start + kept], newest)
        return newest, pos + kept
