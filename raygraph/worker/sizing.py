"""How much device memory one rank's KV cache may take, measured at start-up around the
weights, one forward's activations and (VMM pool) the graphs' largest captures."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch
from torch import nn

from raygraph.config import ModelConfig, ServeConfig
from raygraph.graph.executor import EagerExecutor, Executor
from raygraph.protocol import BucketKey, SeqChunk, StepPlan

log = logging.getLogger("raygraph.worker")


class SizingWorker(Protocol):
    """What sizing reads and calls on the worker (worker/worker.py's Worker, which calls
    sizing at load): its config, device and model, a throwaway KV cache, an executor over
    it, and where the measured graph budget goes."""

    cfg: ServeConfig
    rank: int
    device: torch.device
    model: nn.Module
    graph_budget: int | None
    graph_measured: int

    def _bind_kv_cache(self, num_blocks: int) -> None: ...

    def _make_executor(self, graph_budget: int | None) -> Executor: ...


def kv_bytes_per_block(cfg: ServeConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    kv_heads = model.kv_heads_per_rank(cfg.parallel.tp)
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * model.num_layers * cfg.cache.block_size * kv_heads * model.head_dim * elem


def kv_cache_budget(w: SizingWorker) -> int:
    """Bytes for the KV cache: the configured amount, or (GPU) what the utilization target
    leaves after what is in use, one forward's activations and the graph budget."""
    cache = w.cfg.cache
    if cache.kv_cache_bytes is not None:
        return cache.kv_cache_bytes
    if w.device.type == "cpu":
        return cache.cpu_kv_cache_bytes
    free, total = torch.cuda.mem_get_info(w.device)
    t0 = time.perf_counter()
    activation = _activation_bytes(w)
    t1 = time.perf_counter()
    graphs = graph_bytes(w)
    log.info("rank %d: KV sizing: one forward's activations %.1f MiB (%.2fs), graphs %.1f MiB "
             "(%.2fs)", w.rank, activation / 2**20, t1 - t0, graphs / 2**20,
             time.perf_counter() - t1)
    budget = int(total * cache.gpu_memory_utilization) - (total - free) - activation - graphs
    if budget <= 0:
        raise MemoryError(
            f"rank {w.rank}: no GPU memory left for the KV cache "
            f"(total {total >> 20} MiB, in use {(total - free) >> 20} MiB, "
            f"activations {activation >> 20} MiB, graphs {graphs >> 20} MiB, "
            f"utilization {cache.gpu_memory_utilization})"
        )
    return budget


def graph_bytes(w: SizingWorker) -> int:
    """What graph mode will hold, so the KV cache is sized around it exactly.

    With the VMM pool, graph memory is the largest single capture: capture the largest
    bucket of each phase over a throwaway pool and cache, and cap the real pool at that
    physical size plus `vmm_headroom` (a capture needing more then fails loudly). The
    persistent input buffers count too. torch pools cannot be measured before capture:
    0 (unbudgeted).
    """
    g = w.cfg.executor_graph()
    if g.mode != "graph" or g.backend == "eager" or g.pool != "vmm":
        return 0
    w._bind_kv_cache(1)  # dummy capture batches write no slot and read block 0 only
    ex = w._make_executor(None)
    try:
        largest: dict[str, BucketKey] = {}
        for key in ex.schedule():  # largest first within each phase
            largest.setdefault(key.phase, key)
        for key in largest.values():
            ex.capture(key)
        w.graph_measured = ex.pool.held_bytes()
        chunk = ex.pool.vmm.chunk_size
        w.graph_budget = -(-int(w.graph_measured * (1 + g.vmm_headroom)) // chunk) * chunk
        log.info("graph budget %.1f MiB: largest buckets took %.1f MiB, headroom %.0f%%",
                 w.graph_budget / 2**20, w.graph_measured / 2**20, 100 * g.vmm_headroom)
        return w.graph_budget + ex.input_buffer_bytes
    finally:
        ex.release()
        w._bind_kv_cache(0)
        torch.cuda.empty_cache()

def _activation_bytes(w: SizingWorker) -> int:
    """Peak memory of one forward at the step token budget, over a throwaway cache."""
    n = w.cfg.scheduler.max_num_batched_tokens
    bs = w.cfg.cache.block_size
    blocks = -(-n // bs)
    w._bind_kv_cache(blocks)
    torch.cuda.reset_peak_memory_stats(w.device)
    before = torch.cuda.memory_allocated(w.device)
    # with LoRA, through an (empty) adapter slot: its deltas' activations count too
    chunk = SeqChunk(0, [0] * n, 0, list(range(blocks)), True,
                     lora_slot=0 if w.cfg.lora.enabled else -1)
    EagerExecutor(w.model, bs).logits(StepPlan(-1, [chunk], num_comm_tokens=n))
    torch.cuda.synchronize(w.device)
    peak = torch.cuda.max_memory_allocated(w.device) - before
    w._bind_kv_cache(0)
    torch.cuda.empty_cache()
    return peak
