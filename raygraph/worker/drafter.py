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

from collections.abc import Callable

import torch

from raygraph.config import ModelConfig, ServeConfig
from raygraph.graph.inputs import InputBuffers, feed_tokens, host_inputs
from raygraph.model import ops
from raygraph.model.context import AttentionMetadata, ForwardContext, forward_context
from raygraph.model.loader import build_model
from raygraph.model.parallel import Comm
from raygraph.protocol import SeqChunk, StepPlan


class Drafter:
    """The draft model, its KV cache, its catch-up and its proposal loop: where the target
    runs in graphs, CUDA graphs per batch size captured at their first use (the catch-up of
    decode-shaped steps: verify chunks as decode rows; a prefill runs eagerly); eager
    elsewhere."""

    def __init__(self, cfg: ServeConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model_cfg = model_cfg
        self.k = cfg.speculative.num_speculative_tokens
        self.block_size = bs = cfg.cache.block_size
        self.max_seqs = n = cfg.scheduler.max_num_seqs
        self.device, self.dtype = device, dtype
        # replicated on every drafting rank: no TP group
        self.model = build_model(model_cfg, Comm(), dtype, device,
                                 load_format=cfg.load_format)
        max_len = cfg.max_model_len(cfg.model_cfg())
        # the catch-up's inputs: decode rows (verify chunks' too) up to max_num_seqs rows,
        # as the scheduler keeps them; past that a verify step is prefill-shaped
        self.bufs = InputBuffers(cfg.scheduler.max_num_batched_tokens, n, -(-max_len // bs),
                                 device, verify=True)
        self.lookahead = -(-self.k // bs) + 1  # blocks a proposal may run past a table
        self.first_lookahead = 0  # set by bind_kv: the lookahead blocks follow the shared ones
        self.width = -(-max_len // bs) + self.lookahead
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # the loop's inputs and output at fixed addresses (its graphs read and write them)
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(n, self.k, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        self.starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphed = device.type == "cuda" and cfg.uses_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the loop's, by rows
        self.catch_up_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by decode rows
        self._pool = torch.cuda.graph_pool_handle() if self.graphed else None
        # host staging of a proposal's inputs, pinned on a GPU (a copy from pageable memory
        # would wait for the step's forward), two so one fills while the other uploads
        size = n * (4 + self.k + self.width)
        self._host = [torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
                      for _ in range(2)]
        self._turn = 0

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
        self.graphs.clear()  # they captured the old cache's addresses
        self.catch_up_graphs.clear()
        return total * self.bytes_per_block()

    @torch.inference_mode()
    def catch_up(self, plan: StepPlan, prev_tokens: torch.Tensor) -> None:
        """The draft model's K/V for every token of the target's step (eager, its inputs
        through pinned buffers). `prev_tokens`: the buffer the step's fed tokens read (read
        before this step's samples overwrite it)."""
        if not plan.seqs:
            return
        h = host_inputs(plan, self.block_size, max_rows=self.max_seqs)
        n, b = h.num_tokens, h.num_seqs
        graphed = self.graphed and h.decode
        if graphed:  # padded: each padding row a sequence of no keys
            n = b = self._bucket(n)
        self.bufs.fill(h, n, b)
        md = self.bufs.metadata(n, b, h.num_tokens, h.max_q_len, max(h.seq_lens), h.decode)

        def forward() -> None:
            ids = feed_tokens(self.bufs.input_ids[:n], self.bufs.feed[:n], prev_tokens)
            with forward_context(ForwardContext(md)):
                self.model(ids, self.bufs.positions[:n])

        if not graphed:
            forward()
        elif n in self.catch_up_graphs:
            self.catch_up_graphs[n].replay()
        else:
            self.catch_up_graphs[n] = self._capture(forward)

    @torch.inference_mode()
    def propose(self, chunks: list[SeqChunk], tokens: torch.Tensor,
                targets: torch.Tensor | None) -> torch.Tensor | None:
        """[D, k] greedy drafts after the newest token of each chunk that asks for them
        (`SeqChunk.propose`), in order; None when none asks. `chunks`: the step's sampling
        chunks; `tokens` [S]: their sampled tokens; `targets`: the target's token at every
        logits row where a chunk verified drafts (worker/speculative.py), else None. The
        result is the loop's buffer: read it before the next proposal."""
        asks = [i for i, c in enumerate(chunks) if c.propose]
        if not asks:
            return None
        d = len(asks)
        n = self._bucket(d) if self.graphed else d
        k = max(chunks[i].verify for i in asks) if targets is not None else 0
        staged = self._stage(chunks, asks, n, k)
        ask, first, start, verifies = staged[: 4 * d].view(4, d)
        drafts = staged[4 * d: (4 + k) * d].view(d, k)
        newest, pos = tokens[ask], first
        if k:  # after a verify chunk's kept drafts, the target's token there
            at = (start.unsqueeze(1) + torch.arange(k, device=self.device)).clamp(
                max=len(targets) - 1)
            kept = (drafts == targets[at]).long().cumprod(1).sum(1)  # padding -1 never equal
            newest = torch.where(verifies > 0, targets[start + kept], newest)
            pos = pos + kept
        self.tokens[:d].copy_(newest)
        self.positions[:d].copy_(pos)
        self.tables[:n].copy_(staged[(4 + k) * d:].view(n, self.width))
        if n > d:  # padding rows: position 0 of the scratch block
            self.tokens[d:n].zero_()
            self.positions[d:n].zero_()
        if not self.graphed:
            self._loop(n)
        elif n in self.graphs:
            self.graphs[n].replay()
        else:
            self.graphs[n] = self._capture(lambda: self._loop(n))
        return self.drafts[:d]

    def _bucket(self, rows: int) -> int:
        """The graph size that runs `rows` rows: the next power of two, max_num_seqs at most."""
        return min(1 << (rows - 1).bit_length(), self.max_seqs)

    def _stage(self, chunks: list[SeqChunk], asks: list[int], n: int, k: int) -> torch.Tensor:
        """The proposal's host inputs on the device in one copy: [asks | their newest
        token's position before any kept draft | their first logits row | drafts verified |
        the drafts (-1 padded) | the tables (n rows; past its blocks a sequence's own
        lookahead blocks, then the scratch block)]."""
        d, w = len(asks), self.width
        host = self._host[self._turn]
        self._turn ^= 1
        rows, row = [], 0
        for c in chunks:
            rows.append(row)
            row += 1 + c.verify
        cs = [chunks[i] for i in asks]
        heads = [*asks, *(c.start_pos + len(c.token_ids) - c.verify for c in cs),
                 *(rows[i] for i in asks), *(c.verify for c in cs)]
        if k:
            heads += [t for c in cs
                      for t in c.token_ids[len(c.token_ids) - c.verify:] + [-1] * (k - c.verify)]
        scratch = self.first_lookahead - 1  # the target's scratch block: never read
        tables: list[int] = []
        for j, c in enumerate(cs):
            first = self.first_lookahead + j * self.lookahead
            tables += c.block_table
            tables += range(first, first + self.lookahead)
            tables += [scratch] * (w - len(c.block_table) - self.lookahead)
        tables += [scratch] * ((n - d) * w)
        size = len(heads) + len(tables)
        view = host[:size].numpy()
        view[: len(heads)] = heads
        view[len(heads):] = tables
        return host[:size].to(self.device, non_blocking=True)

    def _loop(self, n: int) -> None:
        """k greedy decode steps of the first n rows of the loop's buffers."""
        bs, last = self.block_size, self.model_cfg.max_position_embeddings - 1
        table, rows = self.tables[:n], self.rows[:n]
        x, pos = self.tokens[:n], self.positions[:n]
        for step in range(self.k):
            p = (pos + step).clamp(max=last)  # past the context: a draft never verified
            slots = table[rows, p // bs].long() * bs + p % bs
            md = AttentionMetadata(slots, table, (p + 1).int(), self.starts[: n + 1], p, rows,
                                   torch.zeros_like(rows), n, 1, self.width * bs, decode=True)
            with forward_context(ForwardContext(md)):
                hidden = self.model(x, p)
            x = ops.argmax(self.model.compute_logits(hidden).float())
            self.drafts[:n, step].copy_(x)

    def _capture(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`run` as a graph. Its warm-up run (kernels compiled) computes this step's work,
        which capturing does not; so it is not replayed now."""
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            run()
        return graph
