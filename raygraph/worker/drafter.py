"""Draft proposers on the worker: a draft model (speculative method "draft"), a small model
of the target's tokenizer, or an EAGLE-3 head ("eagle3", model/eagle3.py) over the target's
hidden states. Either proposes each speculating sequence's next k tokens, greedily, in the
same step in which the target computed the token before them.

Its KV cache shares the target's block tables and follows every token the target computes
(prompt chunks, decodes and verified drafts alike), so a block holds the drafter's keys for
the same tokens as the target's, through prefix-cache hits and preemption: a draft model
runs over the step's tokens (`catch_up`, before the step's samples); a head, which reads the
token after each position, over the same rows once the samples are known (`propose`). A
proposal then decodes from each asking sequence's newest token: which drafts the target
kept, and so where the newest token sits, is read on the device, with no host sync. Where a
proposal runs past a sequence's blocks it writes into lookahead blocks of its own, which
nothing reads after that proposal (the verify step recomputes those positions). Only the
rank that samples drafts: its proposals return with the step's tokens.

Over 500 lines because the two proposers are subclasses of one Drafter, which holds what
they share (the KV binding, the graphs of each pass and proposal loop, the staging of a
proposal's inputs); apart, each would repeat it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain

import numpy as np
import torch
from torch import nn

from raygraph.config import ModelConfig, ServeConfig
from raygraph.graph.buckets import bucket_plan
from raygraph.graph.inputs import InputBuffers, feed_tokens, host_inputs, padding_inputs
from raygraph.graph.upload import TableCopy
from raygraph.model import ops
from raygraph.model.checkpoint import read_headers
from raygraph.model.context import AttentionMetadata, ForwardContext, forward_context
from raygraph.model.loader import build_model, dummy_tensor
from raygraph.model.parallel import Comm, VocabParallelEmbedding
from raygraph.protocol import SeqChunk, StepPlan


class Spans:
    """Up to `most` stretches of one step's work (the drafter's), timed where they run: CUDA
    events around each on a GPU (made once, recorded again every step it times), read once
    the step is done; the host clock on a CPU, where the work is done as it is called."""

    def __init__(self, cuda: bool, most: int = 2) -> None:
        self.pairs = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
                      for _ in range(most)] if cuda else []
        self.used = 0  # pairs recorded this step
        self.host_s = 0.0

    def reset(self) -> Spans:
        """Ready for a new step."""
        self.used, self.host_s = 0, 0.0
        return self

    @contextmanager
    def span(self) -> Iterator[None]:
        if self.pairs:
            start, end = self.pairs[self.used]
            self.used += 1
            start.record()
            yield
            end.record()
        else:
            t0 = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - t0

    def seconds(self) -> float:
        """Their total; on a GPU only once the step's last event has completed."""
        return self.host_s + sum(a.elapsed_time(b) for a, b in self.pairs[: self.used]) / 1e3


def make_drafter(cfg: ServeConfig, draft: ModelConfig, target: nn.Module, dtype: torch.dtype,
                 device: torch.device) -> Drafter:
    """The drafter `draft` (ServeConfig.draft_cfg) describes, beside the `target` model."""
    if draft.family == "eagle3":
        return Eagle3Drafter(cfg, draft, target, dtype, device)
    return ModelDrafter(cfg, draft, dtype, device)


class Drafter:
    """A drafter's KV cache, input buffers, graphs and proposal loop; the subclasses say what
    runs. Where the target runs in graphs, the passes over a step's rows (decode-shaped
    steps: verify chunks as decode rows; a prefill runs eagerly) and the loops are CUDA
    graphs per batch size, captured with the KV cache (`capture_all`); eager elsewhere."""

    model: nn.Module
    passes_after_samples = False  # its pass over a step's rows needs the step's samples

    def __init__(self, cfg: ServeConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model_cfg = model_cfg
        self.k = cfg.speculative.num_speculative_tokens
        self.block_size = bs = cfg.cache.block_size
        self.max_seqs = n = cfg.scheduler.max_num_seqs
        self.device, self.dtype = device, dtype
        max_len = cfg.max_model_len(cfg.model_cfg())
        self.max_tokens = cfg.scheduler.max_num_batched_tokens
        # a step's rows: decode rows (verify chunks' too) up to max_num_seqs rows, as the
        # scheduler keeps them; past that a verify step is prefill-shaped
        self.max_rows = max(self.max_tokens, n)  # a step's rows, padded ones included
        self.bufs = InputBuffers(self.max_rows, n, -(-max_len // bs), device, verify=True,
                                 decode_starts=not ops.decode_kernel_takes(model_cfg.head_dim))
        self.lookahead = -(-self.k // bs) + 1  # blocks a proposal may run past a table
        self.first_lookahead = 0  # set by bind_kv: the lookahead blocks follow the shared ones
        self.width = -(-max_len // bs) + self.lookahead
        # the loop's inputs and output at fixed addresses (its graphs read and write them)
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(n, self.k, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        self.starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphed = device.type == "cuda" and cfg.uses_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the loop's, by rows
        self.pass_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # over a step's decode rows
        # a size without its graphs is captured when first used (True), or runs eagerly
        # until `capture_upto` reaches it (background capture: no step waits for one)
        self.capture_on_use = True
        self._pool = torch.cuda.graph_pool_handle() if self.graphed else None
        # host staging of a proposal's inputs, pinned on a GPU (a copy from pageable memory
        # would wait for the step's forward), two so one fills while the other uploads; the
        # tables' mirror keeps what earlier proposals wrote past each row's used part (valid
        # blocks that no query reaches), so a proposal writes only the blocks it uses
        pinned = device.type == "cuda"
        size = n * (4 + self.k) + 3 * (self.max_rows + n)
        self._host = [torch.zeros(size, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._host_tables = [torch.zeros(n, self.width, dtype=torch.int32, pin_memory=pinned)
                             for _ in range(2)]
        # a proposal uploads its rows' used columns only (a table row spans the context)
        self._table_copies = [TableCopy(t, self.tables) for t in self._host_tables]
        self._lookahead_rows = np.arange(self.lookahead, dtype=np.int32)
        self._turn = 0
        self._step: tuple[int, AttentionMetadata, bool] | None = None  # catch_up's rows

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def bytes_per_block(self) -> int:
        m = self.model_cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return (2 * len(self.model.attention_layers()) * self.block_size * m.num_kv_heads
                * m.head_dim * elem)

    def kv_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) cache beside the target's `num_blocks`: those blocks, its
        scratch block, then the lookahead blocks."""
        m = self.model_cfg
        total = num_blocks + 1 + self.max_seqs * self.lookahead
        return total, self.block_size, m.num_kv_heads, m.head_dim

    def bind_kv(self, num_blocks: int,
                pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """A cache of the target's `num_blocks` (`kv_shape`): `pairs` (k, v) per attention
        layer, zeroed, where the worker's sleep memory holds them, else new tensors; returns
        its bytes."""
        self.first_lookahead = num_blocks + 1
        shape = self.kv_shape(num_blocks)
        layers = self.model.attention_layers()
        if pairs is None:
            pairs = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                      torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in layers]
        for layer, (k, v) in zip(layers, pairs, strict=True):
            layer.k_cache, layer.v_cache = k, v
        self.release_graphs()  # they captured the old cache's addresses
        return shape[0] * self.bytes_per_block()

    def release_graphs(self) -> int:
        """Drop every graph; their pool's memory goes back to the device (the bytes freed
        are returned). `capture_all` captures them again."""
        if not self.graphs and not self.pass_graphs:
            return 0
        before = torch.cuda.memory_reserved(self.device)
        self.graphs.clear()
        self.pass_graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_reserved(self.device))

    @torch.inference_mode()
    def catch_up(self, plan: StepPlan, prev_tokens: torch.Tensor) -> None:
        """Before the step's samples: its rows into the input buffers (pinned, one upload),
        then what the drafter takes of them (`_absorb`). `prev_tokens`: the buffer the
        step's fed tokens read (read before this step's samples overwrite it)."""
        self._step = None
        if not plan.seqs:
            return
        h = host_inputs(plan, self.block_size, max_rows=self.max_seqs)
        n, b = h.num_tokens, h.num_seqs
        graphed = self.graphed and h.decode
        if graphed:  # padded: each padding row a sequence of no keys
            n = b = self._bucket(n)
        self.bufs.fill(h, n, b)
        md = self.bufs.metadata(n, b, h.num_tokens, h.max_q_len, max(h.seq_lens), h.decode)
        self._step = (n, md, graphed)
        self._absorb(plan, h.num_tokens, prev_tokens)

    def _absorb(self, plan: StepPlan, num_tokens: int, prev_tokens: torch.Tensor) -> None:
        raise NotImplementedError

    def _pass(self, n: int, md: AttentionMetadata, prev_tokens: torch.Tensor
              ) -> Callable[[], None] | None:
        """The subclass's pass over n rows of the input buffers (None: it has none)."""
        return None

    def _run_pass(self, prev_tokens: torch.Tensor) -> None:
        """The pass over the step's rows: eager, or its graph (by rows) where decode-shaped."""
        n, md, graphed = self._step
        self._run(self.pass_graphs, n, self._pass(n, md, prev_tokens), graphed)

    def _run(self, graphs: dict[int, torch.cuda.CUDAGraph], n: int, run: Callable[[], None],
             graphed: bool = True) -> None:
        """`run` of n rows: its graph replayed, captured now (`capture_on_use`), or eagerly."""
        if graphed and self.graphed and n in graphs:
            graphs[n].replay()
        elif graphed and self.graphed and self.capture_on_use:
            graphs[n] = self._capture(run)
        else:
            run()

    @torch.inference_mode()
    def capture_all(self, prev_tokens: torch.Tensor) -> int:
        """Every graph a step may replay, captured now (at start-up or wake: no step waits
        for a capture); returns how many there are. `prev_tokens`: the buffer the target's
        fed tokens read."""
        self.capture_upto(self.max_seqs, prev_tokens)
        return len(self.graphs) + len(self.pass_graphs)

    def sizes_upto(self, rows: int) -> list[int]:
        """The graph sizes of up to `rows` rows (max_num_seqs at most) not captured yet."""
        top = self._bucket(min(rows, self.max_seqs))
        return sorted(n for n in {self._bucket(r) for r in range(1, self.max_seqs + 1)}
                      if n <= top and n not in self.graphs)

    @torch.inference_mode()
    def capture_upto(self, rows: int, prev_tokens: torch.Tensor) -> None:
        """The graphs of every size up to `rows` rows not captured yet (a size's pass and
        loop together), over padding rows in the scratch block (each proposal stages the
        loop's buffers again). Background capture calls it with each decode key (the
        drafter runs no collective: only sampling ranks have one)."""
        sizes = self.sizes_upto(rows) if self.graphed else []
        if not sizes:
            return
        torch.cuda.synchronize(self.device)  # no upload from the pinned mirrors in flight
        scratch = self.first_lookahead - 1
        self.tables.fill_(scratch)
        for mirror in self._host_tables:
            mirror.fill_(scratch)
        self.tokens.zero_()
        self.positions.zero_()
        for n in sizes:
            h = padding_inputs(n, scratch)
            self.bufs.fill(h, n, n)
            run = self._pass(n, self.bufs.metadata(n, n, n, 1, 1, True), prev_tokens)
            if run is not None and n not in self.pass_graphs:
                self.pass_graphs[n] = self._capture(run)
            self.graphs[n] = self._capture(lambda n=n: self._loop(n))

    @torch.inference_mode()
    def propose(self, chunks: list[SeqChunk], tokens: torch.Tensor | None,
                targets: torch.Tensor | None) -> tuple[list[int], torch.Tensor] | None:
        """(the chunks that ask for drafts: `SeqChunk.propose`, [D, k] greedy drafts after
        each one's newest token, in order); None when none asks. Called after every step's
        samples (a drafter that passes over the step's rows then does so). `chunks`: the
        step's sampling chunks; `tokens` [S]: their sampled tokens (None: none samples);
        `targets`: the target's token at every logits row where a chunk verified drafts
        (worker/speculative.py), else None. The result is the loop's buffer: read it
        before the next proposal."""
        asks = [i for i, c in enumerate(chunks) if c.propose]
        if not asks:
            if self.passes_after_samples and self._step is not None:
                staged = self._stage(chunks, [], 0, 0, self._extra(chunks, []))
                self._before_loop(staged, 0, 0, tokens, None)
            return None
        d = len(asks)
        n = self._bucket(d) if self.graphed else d
        k = max(chunks[i].verify for i in asks) if targets is not None else 0
        extra = self._extra(chunks, asks)
        staged = self._stage(chunks, asks, n, k, extra)  # and the tables, into self.tables
        ask, first, start, verifies = staged[: 4 * d].view(4, d)
        drafts = staged[4 * d: (4 + k) * d].view(d, k)
        newest, pos, kept = tokens[ask], first, None
        if k:  # after a verify chunk's kept drafts, the target's token there
            at = (start.unsqueeze(1) + torch.arange(k, device=self.device)).clamp(
                max=len(targets) - 1)
            kept = (drafts == targets[at]).long().cumprod(1).sum(1)  # padding -1 never equal
            newest = torch.where(verifies > 0, targets[start + kept], newest)
            pos = pos + kept
        self.tokens[:d].copy_(newest)
        self.positions[:d].copy_(pos)
        if n > d:  # padding rows: position 0 of the scratch block
            self.tokens[d:n].zero_()
            self.positions[d:n].zero_()
        self._before_loop(staged[(4 + k) * d:], d, n, tokens, kept)
        self._run(self.graphs, n, lambda: self._loop(n))
        return asks, self.drafts[:d]

    def _extra(self, chunks: list[SeqChunk], asks: list[int]) -> np.ndarray:
        """More host inputs the subclass stages with the proposal's (`_before_loop`)."""
        return np.zeros(0, dtype=np.int64)

    def _before_loop(self, extra: torch.Tensor, d: int, n: int, tokens: torch.Tensor | None,
                     kept: torch.Tensor | None) -> None:
        """Once the loop's buffers hold the newest tokens and their positions (d = 0: the
        step has no proposal)."""

    def _loop(self, n: int) -> None:
        raise NotImplementedError

    def _bucket(self, rows: int) -> int:
        """The graph size that runs `rows` rows: the next power of two, max_num_seqs at most."""
        return min(1 << (rows - 1).bit_length(), self.max_seqs)

    def _stage(self, chunks: list[SeqChunk], asks: list[int], n: int, k: int,
               extra: np.ndarray) -> torch.Tensor:
        """The proposal's host inputs on the device in one copy: [asks | their newest
        token's position before any kept draft | their first logits row | drafts verified |
        the drafts (-1 padded) | `extra`]; and the columns the loop reads of the first n rows
        of the tables in another (a sequence's blocks, then its own lookahead blocks; padding
        rows the scratch block). Past those columns a row holds blocks an earlier proposal
        wrote: valid, and read by no query."""
        d = len(asks)
        host, mirror = self._host[self._turn], self._host_tables[self._turn].numpy()
        upload = self._table_copies[self._turn]
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
        la = self.lookahead
        cols = la  # columns the loop reads (padding rows: the lookahead's)
        if d:  # every row's blocks, then its lookahead blocks, in one scatter
            lens = np.array([len(c.block_table) for c in cs], dtype=np.int64)
            cols = int(lens.max()) + la
            blocks = np.fromiter(chain.from_iterable(c.block_table for c in cs), np.int32,
                                 int(lens.sum()))
            row = np.repeat(np.arange(d), lens)
            col = np.arange(len(blocks)) - np.repeat(np.cumsum(lens) - lens, lens)
            flat = mirror.reshape(-1)
            flat[row * self.width + col] = blocks
            ahead = (lens[:, None] + np.arange(d)[:, None] * self.width
                     + self._lookahead_rows[None, :])
            flat[ahead] = (self.first_lookahead + np.arange(d)[:, None] * la
                           + self._lookahead_rows[None, :])
        # padding rows: the target's scratch block (never read) in every column their loop
        # steps reach, the lookahead's (k past a block size reaches column 1 and on)
        mirror[d:n, :la] = self.first_lookahead - 1
        if n:
            upload(n, cols)
        size = len(heads) + len(extra)
        view = host[:size].numpy()
        view[: len(heads)] = heads
        view[len(heads):] = extra
        return host[:size].to(self.device, non_blocking=True)

    def _loop_metadata(self, n: int, p: torch.Tensor) -> AttentionMetadata:
        """A loop step of n rows, one token each at positions p, through the loop's tables."""
        bs, table, rows = self.block_size, self.tables[:n], self.rows[:n]
        slots = table[rows, p // bs].long() * bs + p % bs
        return AttentionMetadata(slots, table, (p + 1).int(), self.starts[: n + 1], p, rows,
                                 torch.zeros_like(rows), n, 1, self.width * bs, decode=True)

    def _capture(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`run` as a graph. Its warm-up run (kernels compiled) computes this step's work,
        which capturing does not; so it is not replayed now."""
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            run()
        return graph


class ModelDrafter(Drafter):
    """A draft model: it runs over the step's tokens at their positions, then decodes k
    tokens from the newest one."""

    def __init__(self, cfg: ServeConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        # replicated on every drafting rank: no TP group
        self.model = build_model(model_cfg, Comm(), dtype, device,
                                 load_format=cfg.load_format)
        super().__init__(cfg, model_cfg, dtype, device)

    def _absorb(self, plan: StepPlan, num_tokens: int, prev_tokens: torch.Tensor) -> None:
        self._run_pass(prev_tokens)

    def _pass(self, n: int, md: AttentionMetadata, prev_tokens: torch.Tensor
              ) -> Callable[[], None]:
        def forward() -> None:
            ids = feed_tokens(self.bufs.input_ids[:n], self.bufs.feed[:n], prev_tokens)
            with forward_context(ForwardContext(md)):
                self.model(ids, self.bufs.positions[:n])

        return forward

    def _loop(self, n: int) -> None:
        """k greedy decode steps of the first n rows of the loop's buffers."""
        last = self.model_cfg.max_position_embeddings - 1
        x, pos = self.tokens[:n], self.positions[:n]
        for step in range(self.k):
            p = (pos + step).clamp(max=last)  # past the context: a draft never verified
            with forward_context(ForwardContext(self._loop_metadata(n, p))):
                hidden = self.model(x, p)
            x = ops.argmax(self.model.compute_logits(hidden).float())
            self.drafts[:n, step].copy_(x)


class Eagle3Drafter(Drafter):
    """An EAGLE-3 head. The target writes the residual stream entering three of its layers
    into `aux` on every forward. Once the step's samples are known the head runs over the
    step's rows, each with the token after it (the next row's, or for a chunk's newest
    token the sampled one) and the target's hidden state there; the row before each asking
    sequence's newest token (its anchor) gives the first draft and the hidden state the
    head's k - 1 further steps start from."""

    passes_after_samples = True

    def __init__(self, cfg: ServeConfig, model_cfg: ModelConfig, target: nn.Module,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = build_model(model_cfg, Comm(), dtype, device,
                                 load_format=cfg.load_format)
        if self.model.embed_tokens is None:  # the checkpoint has none: the target's
            self.model.embed_tokens = target_embedding(cfg, target, dtype, device)
        super().__init__(cfg, model_cfg, dtype, device)
        plan = bucket_plan(cfg)  # graphs pad a step's rows up to their bucket
        h, rows = model_cfg.hidden_size, max(self.max_rows, plan.max_size if plan else 0)
        base = target.model
        base.aux_layers = model_cfg.aux_layers
        base.aux = torch.zeros(rows, 3 * h, dtype=dtype, device=device)
        self.aux = base.aux
        self.step_ids = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.next_ids = torch.zeros(self.max_rows, dtype=torch.long, device=device)
        self.normed = torch.zeros(self.max_rows, h, dtype=dtype, device=device)
        self.prenorm = torch.zeros(self.max_rows, h, dtype=dtype, device=device)
        self.anchors = torch.zeros(self.max_seqs, dtype=torch.long, device=device)
        self._shift = np.zeros(0, dtype=np.int64)  # catch_up's: each row's next row
        self._sample_rows: list[int] = []  # catch_up's: each sampling chunk's last row
        self._known: list[tuple[int, int]] = []  # catch_up's: chunks' next known tokens

    def _absorb(self, plan: StepPlan, num_tokens: int, prev_tokens: torch.Tensor) -> None:
        """The step's tokens (fed ones read now), and which row follows which."""
        n = self._step[0]
        self.step_ids[:n].copy_(
            feed_tokens(self.bufs.input_ids[:n], self.bufs.feed[:n], prev_tokens))
        shift, row, self._sample_rows = np.arange(1, n + 1, dtype=np.int64), 0, []
        self._known = []
        for c in plan.seqs:
            row += len(c.token_ids)
            shift[row - 1] = row - 1  # a chunk's last row: the sampled or known token
            if c.sample:
                self._sample_rows.append(row - 1)
            elif c.next_token >= 0:
                self._known.append((row - 1, c.next_token))
        shift[num_tokens:] = np.arange(num_tokens, n)
        self._shift = shift

    def _extra(self, chunks: list[SeqChunk], asks: list[int]) -> np.ndarray:
        """[each row's next row | each sampling chunk's last row | each asking chunk's
        anchor before any kept draft | the rows whose next token is known | those tokens]."""
        last = self._sample_rows
        anchors = [last[i] - chunks[i].verify for i in asks]
        known = [r for r, _ in self._known] + [t for _, t in self._known]
        return np.concatenate([self._shift, np.array(last + anchors + known, dtype=np.int64)])

    def _before_loop(self, extra: torch.Tensor, d: int, n: int, tokens: torch.Tensor | None,
                     kept: torch.Tensor | None) -> None:
        rows, s, m = self._step[0], len(self._sample_rows), len(self._known)
        shift, last = extra[:rows], extra[rows: rows + s]
        anchors = extra[rows + s: rows + s + d] + (kept if kept is not None else 0)
        known = extra[rows + s + d:].view(2, m)
        nxt = self.step_ids[:rows][shift]
        nxt[known[0]] = known[1]  # a prompt chunk's next token
        if tokens is not None:
            nxt[last] = tokens  # a chunk's newest token follows its last row
        nxt[anchors] = self.tokens[:d]  # or after kept drafts, the target's token there
        self.next_ids[:rows].copy_(nxt)
        self.anchors[:d].copy_(anchors)
        if n > d:
            self.anchors[d:n].zero_()
        self._run_pass(self.step_ids)  # reads no fed token

    def _pass(self, n: int, md: AttentionMetadata, prev_tokens: torch.Tensor
              ) -> Callable[[], None]:
        def forward() -> None:
            hidden = self.model.combine(self.aux[:n])
            with forward_context(ForwardContext(md)):
                normed, prenorm = self.model(self.next_ids[:n], self.bufs.positions[:n],
                                             hidden)
            self.normed[:n].copy_(normed)
            self.prenorm[:n].copy_(prenorm)

        return forward

    def _loop(self, n: int) -> None:
        """The first draft from each anchor row, then k - 1 greedy steps of the head."""
        last = self.model_cfg.max_position_embeddings - 1
        at = self.anchors[:n]
        x, hidden, pos = self.model.greedy(self.normed[at]), self.prenorm[at], self.positions[:n]
        self.drafts[:n, 0].copy_(x)
        for step in range(1, self.k):
            p = (pos + step - 1).clamp(max=last)  # past the context: a draft never verified
            with forward_context(ForwardContext(self._loop_metadata(n, p))):
                normed, hidden = self.model(x, p, hidden)
            x = self.model.greedy(normed)
            self.drafts[:n, step].copy_(x)


def target_embedding(cfg: ServeConfig, target: nn.Module, dtype: torch.dtype,
                     device: torch.device) -> nn.Module:
    """The target's token embedding for a head that has none: the target's own where it is
    whole (TP = 1), else a whole copy read from the target's checkpoint."""
    emb = target.model.embed_tokens
    if emb.comm.world_size == 1:
        return emb
    m = cfg.model_cfg()
    whole = VocabParallelEmbedding(m.vocab_size, m.hidden_size, Comm()).to(device, dtype)
    name = "model.embed_tokens.weight"
    if cfg.load_format == "dummy":
        whole.weight.data.copy_(dummy_tensor(name, tuple(whole.weight.shape), whole.weight))
        return whole
    from safetensors import safe_open

    file = next(f for f, tensors in read_headers(m.path) if name in tensors)
    with safe_open(str(file), framework="pt") as f:
        whole.weight.data.copy_(f.get_tensor(name))
    return whole
