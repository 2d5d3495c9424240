"""The executor seam: the worker hands it a StepPlan and gets logits back.

Eager is the reference and is always available. The graph executor buckets each step,
fills the persistent input buffers, and replays (or first captures) the bucket's graph:
a full graph for decode, a piecewise graph for prefill; above the largest bucket it runs
eagerly. On CPU the same executor runs with the eager backend (no capture).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

import torch

from raygraph.config import GraphConfig
from raygraph.graph.buckets import bucket, capture_schedule, capture_sizes
from raygraph.graph.inputs import HostInputs, InputBuffers, batch_from, host_inputs
from raygraph.graph.runners import FullGraph, PiecewiseGraph
from raygraph.model.context import ForwardContext, forward_context
from raygraph.model.llama import LlamaForCausalLM
from raygraph.protocol import BucketKey, StepPlan

log = logging.getLogger("raygraph.graph")


class Executor(ABC):
    def __init__(self, model: LlamaForCausalLM, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device

    @abstractmethod
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """Float32 logits [S, vocab], one row per sampling sequence, in plan order."""


class EagerExecutor(Executor):
    def logits(self, plan: StepPlan) -> torch.Tensor:
        return self.run(host_inputs(plan, self.block_size))

    @torch.inference_mode()
    def run(self, h: HostInputs) -> torch.Tensor:
        batch = batch_from(h, self.device)
        with forward_context(batch.ctx):
            hidden = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden[batch.sample_idx]).float()


class GraphExecutor(Executor):
    def __init__(self, model: LlamaForCausalLM, cfg: GraphConfig, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        super().__init__(model, block_size)
        self.cfg = cfg
        self.cuda = self.device.type == "cuda" and cfg.backend != "eager"
        self.decode_sizes = capture_sizes(cfg.decode_sizes, min(max_num_seqs, cfg.max_decode))
        self.prefill_sizes = capture_sizes(cfg.prefill_sizes,
                                           min(max_num_batched_tokens, cfg.max_prefill))
        max_tokens = max(self.decode_sizes[-1], self.prefill_sizes[-1])
        max_seqs = max(self.decode_sizes[-1], max_num_seqs)
        self.bufs = InputBuffers(max_tokens, max_seqs, -(-max_model_len // block_size),
                                 self.device)
        attn = model.attention_layers()[0]
        dtype = next(model.parameters()).dtype
        # one attention output buffer serves every layer and bucket: pieces run in order
        self.attn_out = torch.zeros(max_tokens, attn.num_heads, attn.head_dim, dtype=dtype,
                                    device=self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.graphs: dict[BucketKey, FullGraph | PiecewiseGraph] = {}
        self.eager = EagerExecutor(model, block_size)
        self.capture_log: list[dict] = []
        self.last_key: BucketKey | None = None

    def key_for(self, h: HostInputs) -> BucketKey | None:
        if h.decode:
            n = bucket(h.num_seqs, self.decode_sizes)
            return None if n is None else BucketKey("decode", n)
        n = bucket(h.num_tokens, self.prefill_sizes)
        if n is None or h.num_seqs > self.bufs.max_seqs:
            return None
        return BucketKey("prefill", n)

    def schedule(self) -> list[BucketKey]:
        return capture_schedule(self.decode_sizes, self.prefill_sizes)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        h = host_inputs(plan, self.block_size)
        key = self.key_for(h)
        self.last_key = key
        if key is None:
            return self.eager.run(h)
        num_seqs = key.num_tokens if key.phase == "decode" else h.num_seqs
        self.bufs.fill(h, key.num_tokens, num_seqs)
        md = self.bufs.metadata(key.num_tokens, num_seqs, h.max_q_len, max(h.seq_lens),
                                h.decode)
        if key not in self.graphs:
            self.capture(key, md)
        runner = self.graphs[key]
        if isinstance(runner, FullGraph):
            return runner.run(md)[: h.num_seqs].float()
        hidden = runner.run(md, h.num_tokens)
        rows = torch.tensor(h.sample_idx, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def _forward(self, key: BucketKey, with_logits: bool):
        n = key.num_tokens
        ids, pos = self.bufs.input_ids[:n], self.bufs.positions[:n]

        def forward(ctx: ForwardContext) -> torch.Tensor:
            with forward_context(ctx):
                hidden = self.model(ids, pos)
            return self.model.compute_logits(hidden) if with_logits else hidden

        return forward

    @torch.inference_mode()
    def capture(self, key: BucketKey, md=None) -> dict:
        """Capture one bucket (on a dummy batch when none is given); returns its log entry."""
        if md is None:
            md = self._dummy(key)
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device) if self.cuda else 0
        if key.phase == "decode":
            runner = FullGraph(self._forward(key, True), md, self.cuda, self.pool)
            pieces = 1 if self.cuda else 0
        else:
            runner = PiecewiseGraph(self._forward(key, False), md, self.attn_out, self.cuda,
                                    self.pool)
            pieces = runner.num_pieces
        self.graphs[key] = runner
        entry = {
            "key": (key.phase, key.num_tokens, key.num_comm_tokens), "pieces": pieces,
            "seconds": round(time.perf_counter() - t0, 4),
            "pool_bytes": (torch.cuda.memory_reserved(self.device) - before) if self.cuda else 0,
        }
        self.capture_log.append(entry)
        if self.cuda:
            log.info("captured %s: %d graph(s) in %.3fs, +%.1f MiB", key, pieces,
                     entry["seconds"], entry["pool_bytes"] / 2**20)
        return entry

    def _dummy(self, key: BucketKey):
        """A batch that writes no real KV slot (all slots -1) for start-up capture."""
        n = key.num_tokens
        if key.phase == "decode":
            h = HostInputs([0] * n, [0] * n, [-1] * n, list(range(n)), [0] * n, [1] * n,
                           [[0]] * n, list(range(n)), 1, True)
        else:
            h = HostInputs([0] * n, list(range(n)), [-1] * n, [0] * n, list(range(n)), [n],
                           [[0] * -(-n // self.block_size)], [n - 1], n, False)
        seqs = n if key.phase == "decode" else 1
        self.bufs.fill(h, n, seqs)
        return self.bufs.metadata(n, seqs, h.max_q_len, max(h.seq_lens), h.decode)

    def capture_all(self) -> list[dict]:
        """Capture the whole schedule, largest first; returns the capture log."""
        t0 = time.perf_counter()
        for key in self.schedule():
            if key not in self.graphs:
                self.capture(key)
        if self.cuda:
            log.info("captured %d buckets in %.2fs", len(self.graphs), time.perf_counter() - t0)
        return self.capture_log


def make_executor(cfg: GraphConfig, model: LlamaForCausalLM, block_size: int,
                  max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> Executor:
    if cfg.mode == "eager":
        return EagerExecutor(model, block_size)
    return GraphExecutor(model, cfg, block_size, max_num_seqs, max_num_batched_tokens,
                         max_model_len)
