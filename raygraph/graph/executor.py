"""The executor seam: the worker hands it a StepPlan and gets logits back.

Eager is the reference and is always available. The graph executor buckets each step,
fills the persistent input buffers, and replays (or first captures) the bucket's graph:
a full graph for decode, and for prefill a full graph (the default) or a piecewise one
(`GraphConfig.prefill_graph`); above the largest bucket it runs eagerly. On CPU the same
executor runs with the eager backend (no capture).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import replace

import torch

from raygraph.config import GraphConfig
from raygraph.graph.buckets import IDLE_TOKENS, BucketPlan
from raygraph.graph.inputs import (
    CASCADE_MIN_SEQS,
    HostInputs,
    InputBuffers,
    batch_from,
    feed_tokens,
    host_inputs,
    padding_inputs,
    token_layout,
)
from raygraph.graph.runners import FullGraph, PiecewiseGraph
from raygraph.memory.graph_pool import GraphPool, PrivateGraphPool, TorchGraphPool
from raygraph.memory.stats import GraphPoolStats
from raygraph.memory.vmm_allocator import VmmGraphPool
from raygraph.model import ops
from raygraph.model.context import ForwardContext, forward_context
from raygraph.model.llama import LlamaForCausalLM
from raygraph.model.lora_ops import num_lora_slots
from raygraph.model.parallel import comms_of, recording
from raygraph.protocol import BucketKey, BufferInfo, CaptureRecord, StepPlan

log = logging.getLogger("raygraph.graph")


class KeyMismatch(RuntimeError):
    """A step whose bucket differs from the coordinator's choice, or was never captured in
    lockstep: replaying it would desynchronise the ranks' collectives."""


class Executor(ABC):
    def __init__(self, model: LlamaForCausalLM, block_size: int, max_seqs: int = 1) -> None:
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.lora = num_lora_slots(model) > 0  # steps carry each token's adapter slot
        # the previous step's sampled tokens, which fed tokens read (the worker writes it);
        # graphs capture its address, so it is allocated once
        self.prev_tokens = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self.max_decode_rows: int | None = None  # buckets.drafts_as_rows: any, eagerly

    @abstractmethod
    def step(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [S, vocab] (a graph's in the model's dtype, else float32), one row per
        sampling sequence, in plan order, and their argmax [S] where the step already took
        it on the device (else None)."""

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """A plan's float32 logits (for checks across ranks and modes)."""
        return self.step(plan)[0].float()

    # ---- graphs and their memory: the eager executor has none ---------------------------
    def allows(self, key: BucketKey) -> bool:
        """Whether `key` is in this executor's capture schedule."""
        return False

    def capture(self, key: BucketKey, md=None) -> CaptureRecord:
        raise KeyMismatch(f"{key}: this executor runs eagerly and captures nothing")

    def capture_all(self) -> list[CaptureRecord]:
        return []

    @property
    def input_buffer_bytes(self) -> int:
        return 0

    def pool_stats(self) -> GraphPoolStats | None:
        return None

    def log_memory(self) -> None:
        return None  # no graph memory to tell of

    def sleep(self) -> int:
        """Release graph memory; returns the bytes released (0: none held, e.g. eager)."""
        return 0

    def wake_up(self) -> int:
        """Map graph memory again under the graphs; returns the bytes mapped."""
        return 0

    def release(self) -> None:
        return None  # nothing held beyond the model and the cache

    def scratch_block(self) -> int:
        """The block the worker allocates past the usable ones: padding may write there."""
        return self.model.attention_layers()[0].k_cache.shape[0] - 1

    def inputs(self, plan: StepPlan) -> HostInputs:
        """The plan's host inputs; an idle DP rank (no sequences) runs one padding token."""
        if not plan.seqs:
            return padding_inputs(IDLE_TOKENS, self.scratch_block())
        return host_inputs(plan, self.block_size, self.lora, self.max_decode_rows)


class EagerExecutor(Executor):
    def step(self, plan: StepPlan) -> tuple[torch.Tensor, None]:
        return self.run(self.inputs(plan), plan.num_comm_tokens), None

    @torch.inference_mode()
    def run(self, h: HostInputs, comm: int = 0) -> torch.Tensor:
        batch = batch_from(h, self.device)
        batch.ctx.num_comm_tokens = comm
        ids = batch.input_ids
        if batch.feed is not None:
            ids = feed_tokens(ids, batch.feed, self.prev_tokens)
        with forward_context(batch.ctx):
            hidden = self.model(ids, batch.positions)
        return self.model.compute_logits(hidden[batch.sample_idx]).float()


class GraphExecutor(Executor):
    """graph_budget caps the graph pool's physical memory (VMM pool): the bytes the KV cache
    was sized around; a capture needing more fails loudly."""

    def __init__(self, model: LlamaForCausalLM, cfg: GraphConfig, buckets: BucketPlan,
                 block_size: int, max_num_seqs: int, max_model_len: int,
                 graph_budget: int | None = None, rank: int = 0) -> None:
        super().__init__(model, block_size, max_num_seqs)
        self.cfg = cfg
        self.rank = rank  # the worker's global rank, for capture records
        self.cuda = self.device.type == "cuda" and cfg.backend != "eager"
        self.buckets = buckets
        self.max_decode_rows = buckets.max_verify_rows
        max_tokens = self.buckets.max_size
        max_seqs = self.buckets.max_seqs
        # with LoRA every graph reads each token's slot: one graph serves any mix of adapters
        attn = model.attention_layers()[0]
        self.bufs = InputBuffers(max_tokens, max_seqs, -(-max_model_len // block_size),
                                 self.device, lora=self.lora, cascade=cfg.decode_cascade,
                                 verify=buckets.verify,
                                 decode_starts=not ops.decode_kernel_takes(attn.head_dim))
        dtype = next(model.parameters()).dtype
        # one attention output buffer serves every layer and bucket: pieces run in order
        self.attn_out = torch.zeros(max_tokens, attn.num_heads, attn.head_dim, dtype=dtype,
                                    device=self.device)
        self.pool: GraphPool | None = (
            make_graph_pool(cfg.pool, self.device, cfg.vmm_chunk_bytes, graph_budget)
            if self.cuda else None)
        self.graphs: dict[BucketKey, FullGraph | PiecewiseGraph] = {}
        # a second graph of each decode key that may run the cascade, taken by the steps
        # whose batch shares a prefix: the others launch none of its kernels
        self.cascade_graphs: dict[BucketKey, FullGraph] = {}
        self.last_cascade = False  # whether the last step ran its key's cascade graph
        self.eager = EagerExecutor(model, block_size)
        self.eager.prev_tokens = self.prev_tokens  # one buffer, whichever path runs the step
        self.capture_log: list[CaptureRecord] = []
        self.last_key: BucketKey | None = None
        self.comms = comms_of(model)

    def allows(self, key: BucketKey) -> bool:
        return self.buckets.allows(key)

    def key_for(self, h: HostInputs, comm: int = 0) -> BucketKey:
        return self.buckets.key(h.num_tokens, h.num_seqs, h.decode, comm)

    def schedule(self) -> list[BucketKey]:
        return self.buckets.schedule()

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.inputs(plan)
        key = self.key_for(h, plan.num_comm_tokens)
        self.last_key = key
        if self.pool is not None and self.pool.asleep:
            raise RuntimeError("the graph executor is asleep (graph memory released); "
                               "call wake_up() before running steps")
        uncaptured = False
        if plan.key is not None and plan.key != key:
            # not captured on every rank yet (background capture): every rank runs the
            # bucket's forward uncaptured, padded as its graph will be (the same kernels)
            uncaptured = plan.key == BucketKey("eager", h.num_tokens, plan.num_comm_tokens)
            if not uncaptured:
                raise KeyMismatch(f"step {plan.step_id}: the coordinator chose {plan.key} but "
                                  f"this rank's batch ({h.num_tokens} tokens, {h.num_seqs} "
                                  f"seqs) gives {key}")
        if key.phase == "eager":
            return self.eager.run(h, plan.num_comm_tokens), None
        num_seqs = self.num_seqs(key, h.num_seqs)
        self.bufs.fill(h, key.num_tokens, num_seqs)
        cascade = self.last_cascade = self.has_cascade(key) and self.bufs.shared_prefix > 0
        md = self.bufs.metadata(key.num_tokens, num_seqs, h.num_tokens, h.max_q_len,
                                max(h.seq_lens), h.decode, cascade)
        if uncaptured:
            runner = FullGraph(self._forward(key, self._graph_logits(key)), md, False, None)
        else:
            if key not in self.graphs:
                if plan.key is not None:  # coordinator-driven: captures happen in lockstep only
                    raise KeyMismatch(f"step {plan.step_id}: {key} was never captured on this "
                                      "rank")
                self.capture(key, md)
            runner = (self.cascade_graphs if cascade else self.graphs)[key]
        if key.phase == "decode":
            logits, greedy = (t[: h.num_seqs] for t in runner.run(md))
            if len(h.sample_idx) < h.num_seqs:  # a one-token chunk mid-prompt samples nothing
                rows = self.bufs.sample_idx[: len(h.sample_idx)]
                logits, greedy = logits[rows], greedy[rows]
            return logits, greedy
        if self._graph_logits(key):  # the graph took the sampled rows' logits
            return tuple(t[: len(h.sample_idx)] for t in runner.run(md))
        hidden = runner.run(md)
        rows = self.bufs.sample_idx[: len(h.sample_idx)]
        return self.model.compute_logits(hidden[rows]).float(), None

    def num_seqs(self, key: BucketKey, real: int) -> int:
        """The sequence rows a step of `key` runs with: decode pads to one per token; a full
        prefill graph to a fixed count (its launches read every row; each sequence has a
        token, so no more than the bucket's tokens); piecewise prefill runs the real ones."""
        if key.phase == "decode":
            return key.num_tokens
        if self.cfg.prefill_graph == "full":
            return min(self.bufs.max_seqs, key.num_tokens)
        return real

    def has_cascade(self, key: BucketKey) -> bool:
        """Whether `key` gets a cascade graph: decode buckets that can hold a batch large
        enough for one (GraphConfig.decode_cascade)."""
        return (self.cfg.decode_cascade and key.phase == "decode"
                and key.num_tokens >= CASCADE_MIN_SEQS)

    def _graph_logits(self, key: BucketKey) -> bool:
        """Whether `key`'s graph ends in the logits and greedy tokens: decode, and full
        prefill graphs (their sampled rows: one per sequence row of the bucket). A piecewise
        prefill step takes its logits eagerly after the last piece."""
        return key.phase == "decode" or self.cfg.prefill_graph == "full"

    def _forward(self, key: BucketKey, with_logits: bool):
        n = key.num_tokens
        ids, pos, feed = (self.bufs.input_ids[:n], self.bufs.positions[:n],
                          self.bufs.feed[:n])
        lora = self.bufs.lora_inputs(n)
        # prefill samples a row per sequence at most: the rows the host wrote (the rest 0)
        rows = (None if key.phase == "decode"
                else self.bufs.sample_idx[: self.num_seqs(key, n)])

        def forward(ctx: ForwardContext):
            ctx.num_comm_tokens = key.num_comm_tokens  # the EP dispatch size is in the key
            ctx.lora = lora
            with forward_context(ctx):
                hidden = self.model(feed_tokens(ids, feed, self.prev_tokens), pos)
            if not with_logits:
                return hidden
            if rows is not None:
                hidden = hidden[rows]
            # the greedy argmax inside the graph: a launch off the step's host path. The
            # logits stay in the model's dtype (a float32 copy of every row would be the
            # step's largest elementwise kernel); a sampler widens the rows it draws from
            logits = self.model.compute_logits(hidden)
            return logits, ops.argmax(logits)

        return forward

    @torch.inference_mode()
    def capture(self, key: BucketKey, md=None) -> CaptureRecord:
        """Capture one bucket (on a dummy batch when none is given) and record what it did.

        On the eager backend nothing is captured; the dummy batch runs once instead, so the
        collectives it issues are still recorded and checked across ranks.
        """
        if key.phase == "eager":
            raise ValueError(f"{key} runs eagerly and is never captured")
        dummy = md is None
        if dummy:
            md = self._dummy(key)
        t0 = time.perf_counter()
        md = replace(md, shared_len=None)
        scope = self.pool.capture(key) if self.pool is not None else nullcontext()
        with scope as pool:
            with recording(self.comms) as collectives:
                if self._graph_logits(key):
                    runner = FullGraph(self._forward(key, True), md, self.cuda, pool)
                else:
                    runner = PiecewiseGraph(self._forward(key, False), md, self.attn_out,
                                            self.cuda, pool)
                if not self.cuda and dummy:
                    runner.run(md)
            cascade = None
            if self.has_cascade(key):  # the same collectives again: recorded once
                cascade = FullGraph(self._forward(key, True),
                                    replace(md, shared_len=self.bufs.shared_len), self.cuda, pool)
        self.graphs[key] = runner
        runners = [runner]
        if cascade is not None:
            self.cascade_graphs[key] = cascade
            runners.append(cascade)
        nodes = [r.num_nodes for r in runners]
        record = CaptureRecord(
            key=key, rank=self.rank, pieces=sum(r.num_pieces for r in runners),
            nodes=None if None in nodes else sum(nodes), collectives=collectives,
            pool_bytes=self.pool.last_growth if self.pool is not None else 0,
            buffers=self.buffer_infos(), seconds=round(time.perf_counter() - t0, 4),
        )
        self.capture_log.append(record)
        # per key at DEBUG: under a coordinator, its lockstep log already names every key once
        log.debug("captured %s: %d graph(s), %s nodes, %d collectives in %.3fs, +%.1f MiB", key,
                 record.pieces, record.nodes, len(collectives), record.seconds,
                 record.pool_bytes / 2**20)
        return record

    def buffer_infos(self) -> list[BufferInfo]:
        """The persistent buffers every graph reads: one set, so the same on every key."""
        named = {"tokens": self.bufs.tokens, "block_tables": self.bufs.block_tables,
                 "seq_lens": self.bufs.seq_lens, "attn_out": self.attn_out}
        if self.bufs.lora is not None:
            named["lora"] = self.bufs.lora
        return [BufferInfo(n, t.data_ptr(), list(t.shape)) for n, t in named.items()]

    def _dummy(self, key: BucketKey):
        """A batch that writes no real KV slot (all slots -1) for start-up capture. Prefill
        tokens are split into sequences no longer than the context the buffers hold; tokens
        beyond every sequence row at full length are bucket padding, as in a real step."""
        n = key.num_tokens
        if key.phase == "decode":
            h = padding_inputs(n, self.scratch_block())
        else:
            per = self.bufs.max_blocks * self.block_size
            real = min(n, per * self.bufs.max_seqs)
            lens = [min(per, real - start) for start in range(0, real, per)]
            token_seq, token_row, positions = token_layout(lens, [0] * len(lens))
            h = HostInputs([0] * real, positions, [-1] * real, token_seq, token_row, lens,
                           [[self.scratch_block()] * -(-length // self.block_size)
                            for length in lens],
                           [sum(lens[: i + 1]) - 1 for i in range(len(lens))], max(lens),
                           False)
        seqs = self.num_seqs(key, h.num_seqs)
        self.bufs.fill(h, n, seqs)
        return self.bufs.metadata(n, seqs, h.num_tokens, h.max_q_len, max(h.seq_lens), h.decode)

    def capture_all(self) -> list[CaptureRecord]:
        """Capture the whole schedule, largest first; returns the capture log."""
        t0 = time.perf_counter()
        for key in self.schedule():
            if key not in self.graphs:
                self.capture(key)
        if self.cuda:
            log.info("captured %d buckets in %.2fs", len(self.graphs), time.perf_counter() - t0)
            self.log_memory()
        return self.capture_log

    @torch.inference_mode()
    def warm_logits(self) -> None:
        """Steps whose logits run eagerly (piecewise prefill, eager steps above the largest
        bucket) take them on as many rows as they sample: the skinny-GEMM path JIT-compiles
        per row regime (the first 5-sequence step took 157-184 ms on an H200) and cuBLAS
        loads a kernel per row range on first use. Run every row count a step can sample once
        here, before serving, not in a served step. Every rank runs it in the same order (the
        TP logits gather); a no-op off CUDA."""
        if not self.cuda:
            return
        from raygraph.model.triton_gemv import MAX_M

        hidden = self.model.config.hidden_size
        dtype = self.model.lm_head.weight.dtype
        for rows in range(1, max(MAX_M + 1, self.bufs.max_seqs) + 1):
            self.model.compute_logits(torch.zeros(rows, hidden, dtype=dtype, device=self.device))

    @property
    def input_buffer_bytes(self) -> int:
        """The persistent buffers every graph reads: input buffers and attention output."""
        return self.bufs.nbytes + self.attn_out.numel() * self.attn_out.element_size()

    def pool_stats(self) -> GraphPoolStats | None:
        return self.pool.stats() if self.pool is not None else None

    def log_memory(self) -> None:
        s = self.pool_stats()
        if s is None:
            return
        largest = max(s.capture_bytes.items(), key=lambda kv: kv[1], default=("-", 0))
        log.info("graph memory (%s pool): %.1f MiB held (budget %s), %.1f MiB virtual in %d "
                 "ranges, largest capture %s %.1f MiB; input buffers %.1f MiB", s.kind,
                 s.held_bytes / 2**20, "none" if s.budget_bytes is None
                 else f"{s.budget_bytes / 2**20:.1f} MiB", s.virtual_bytes / 2**20, s.spaces,
                 largest[0], largest[1] / 2**20, self.input_buffer_bytes / 2**20)

    def sleep(self) -> int:
        """Release the graphs' physical memory; they stay captured (VMM pool only: a torch
        pool refuses). No pool (eager backend): nothing to release."""
        if self.pool is None:
            return 0
        held = self.pool.held_bytes()
        self.pool.sleep()
        return held

    def wake_up(self) -> int:
        if self.pool is None or not self.pool.asleep:
            return 0
        self.pool.wake_up()
        return self.pool.held_bytes()

    def release(self) -> None:
        """Drop every graph, then the pool's memory."""
        self.graphs.clear()
        self.cascade_graphs.clear()
        if self.pool is not None:
            self.pool.release()


def make_graph_pool(kind: str, device: torch.device, vmm_chunk_bytes: int,
                    budget_bytes: int | None = None) -> GraphPool:
    """The graph pool `GraphConfig.pool` names; budget_bytes caps the VMM pool's physical
    memory (torch pools cannot be capped)."""
    if kind == "torch":
        return TorchGraphPool(device)
    if kind == "private":
        return PrivateGraphPool(device)
    if kind == "vmm":
        return VmmGraphPool(device, vmm_chunk_bytes, budget_bytes)
    raise ValueError(f"unknown graph pool {kind!r}")


def make_executor(cfg: GraphConfig, buckets: BucketPlan | None, model: LlamaForCausalLM,
                  block_size: int, max_num_seqs: int, max_model_len: int,
                  graph_budget: int | None = None, rank: int = 0) -> Executor:
    """The graph executor when there is a bucket plan (graph mode), else the eager one."""
    if cfg.mode == "eager" or buckets is None:
        return EagerExecutor(model, block_size, max_num_seqs)
    return GraphExecutor(model, cfg, buckets, block_size, max_num_seqs, max_model_len,
                         graph_budget, rank)
