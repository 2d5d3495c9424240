"""One worker per GPU (or per CPU slot): owns its device, its model shard, its KV cache and
its executor, and runs the StepPlans its engine sends. A plain class; the engine starts it
as a WorkerActor (actor.py). Over 500 lines because it is one actor's whole surface (load,
step, capture, sleep, LoRA, offload, fault drills); the logic behind each lives in state.py,
sizing.py, sleep.py, warmup.py and graph/."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from raygraph.config import ModelConfig, ServeConfig
from raygraph.errors import LoRAError
from raygraph.graph.buckets import bucket_plan
from raygraph.graph.executor import (
    EagerExecutor,
    Executor,
    GraphExecutor,
    KeyMismatch,
    make_executor,
)
from raygraph.lora import LoRASlots, SlotImage, append_slot_rows, read_adapter
from raygraph.lora.warm import WarmAdapters
from raygraph.memory.offload import apply_offload
from raygraph.memory.offload_engine import OffloadEngine, OffloadStats
from raygraph.memory.stats import MemoryStats, SleepStats
from raygraph.model.loader import build_model
from raygraph.model.ops import FP8_KV
from raygraph.model.parallel import Comm
from raygraph.model.quant import check_fp8_device
from raygraph.process import freeze_heap, setup_logging
from raygraph.protocol import (
    WORKER_CALLS,
    BucketKey,
    CaptureRecord,
    LoRALoad,
    SeqChunk,
    StepDelta,
    StepOutput,
    StepPlan,
    StepResult,
    WorkerCall,
    WorkerInfo,
)
from raygraph.worker.drafter import Drafter, Spans, make_drafter
from raygraph.worker.guides import Guides
from raygraph.worker.sampler import (
    SamplingRows,
    logprob_rows,
    sample_tokens,
    token_logprobs,
    unpack_logprobs,
)
from raygraph.worker.sizing import kv_bytes_per_block, kv_cache_budget
from raygraph.worker.sleep import SleepMemory
from raygraph.worker.speculative import emitted, last_rows, sampled_targets, verify_rows
from raygraph.worker.state import SeqTable, StateError
from raygraph.worker.warmup import start_triton_warmup

log = logging.getLogger("raygraph.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port, for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:
        ip = "127.0.0.1"
    return ip, port


def _throttled(reporter: Any, every_s: float = 0.2) -> Callable[[int, int], None]:
    """A progress callback that tells `reporter` at most every `every_s`, and at the end."""
    last = 0.0

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if done == total or now - last >= every_s:
            last = now
            reporter.report_progress.remote("load", done, total)

    return report


# a step's logprobs: (packed as `token_logprobs` packs them, rows that asked, the chunks)
Logprobs = tuple[torch.Tensor, list[int], list[SeqChunk]]


@dataclass
class _Pending:
    """A queued step whose tokens the coordinator has not been sent yet."""

    step_id: int
    started: float
    tokens: torch.Tensor | None = None  # pinned host copy, being filled
    start: torch.cuda.Event | None = None  # around the step on the device: its device time
    ready: torch.cuda.Event | None = None
    after: torch.cuda.Event | None = None  # the previous step's `ready`
    seconds: float = 0.0
    idle: float = 0.0
    logprobs: Logprobs | None = None  # on the host, being filled
    guided: list[tuple[int, int]] | None = None  # (row, seq id) sampled under a grammar
    verify: list[tuple[int, int, list[int]]] | None = None  # speculative.verify_rows
    targets: torch.Tensor | None = None  # pinned host copy: the greedy token of each row
    drafts: torch.Tensor | None = None  # pinned host copy: the draft model's proposals [D, k]
    proposing: list[int] | None = None  # the sampling rows they follow
    draft: Spans | None = None  # the drafter's work in the step


DELTA = msgspec.msgpack.Decoder(StepDelta)
OUTPUT = msgspec.msgpack.Encoder()


class Worker:
    def __init__(self, cfg: ServeConfig, rank: int) -> None:
        setup_logging()
        self.cfg = cfg
        self.rank = rank
        self.world_size = cfg.parallel.world_size
        self.samples = cfg.parallel.tp_rank(rank) == 0  # one sampler per DP group
        if cfg.device == "cuda":
            self.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES per actor
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(int(os.environ.get("RAYGRAPH_CPU_THREADS", "1")))
        self.dtype = DTYPES[cfg.weights_dtype(self.device.type)]
        # the KV cache's storage: the weights' dtype, or FP8 (ops store and read it back)
        self.kv_dtype = FP8_KV if cfg.cache.cache_dtype == "fp8" else self.dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed)
        self.model_cfg: ModelConfig | None = None
        self._fault: tuple[str, str, BucketKey | None] | None = None
        self.graph_budget: int | None = None  # VMM graph pool cap, measured in load()
        self.graph_measured = 0  # what the largest buckets took when the budget was measured
        self.kv_cache_bytes = 0
        self.weight_bytes = 0  # set by load()
        self.sleep_memory = SleepMemory(rank, self.device)  # weights and KV cache on VMM
        self.state = SeqTable()
        self._pending: _Pending | None = None
        self._last_ready: torch.cuda.Event | None = None
        self._thread = threading.get_ident()  # the thread whose CUDA context is set
        self._thread_switches = 0
        self._frozen = False  # freeze_heap() on the first served call (any device)
        pinned = self.device.type == "cuda"
        n = cfg.scheduler.max_num_seqs
        self._host_tokens = [torch.zeros(n, dtype=torch.long, pin_memory=pinned)
                             for _ in range(2)]  # alternate: step N+1 copies while N is read
        self._sampling = SamplingRows(n, self.device)
        # a verifying step's greedy token per logits row (a row per sequence and draft; the
        # scheduler keeps them to max_num_seqs)
        self._host_targets = [torch.zeros(n, dtype=torch.long, pin_memory=pinned)
                              for _ in range(2)]
        self._host_rows = [torch.zeros(n, dtype=torch.long, pin_memory=pinned)
                           for _ in range(2)]  # its last row per chunk (speculative.last_rows)
        self._host_drafts = [torch.zeros(n, dtype=torch.long, pin_memory=pinned)
                             for _ in range(2)]  # sampled chunks' drafts (sampled_targets)
        self.guides = Guides(cfg.tokenizer or cfg.model, n, self.device)
        self.lora_slots: LoRASlots | None = None  # set by load() when LoRA is on
        self.drafter: Drafter | None = None  # set by load(): method "draft" or "eagle3"
        self.warm_loras = WarmAdapters(cfg.lora.warm_budget_bytes)

    def address(self) -> tuple[str, int]:
        return free_address()

    def load(self, dist_addr: tuple[str, int], reporter: Any = None) -> WorkerInfo:
        """Join the process group, load this rank's shard and measure what the KV cache may
        take. `reporter` (an actor with `report_progress`, rank 0 only) hears how far the
        weights are."""
        t0 = time.perf_counter()
        warmup = start_triton_warmup(self.device)  # while the weights load
        progress = _throttled(reporter) if reporter is not None else None
        comm, ep_comm = Comm(), None
        if self.world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{dist_addr[0]}:{dist_addr[1]}",
                rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=self.cfg.step_timeout_s),
            )
            comm, ep_comm = self._groups()
        self.model_cfg = self.cfg.model_cfg()
        self.cfg.parallel.check_model(self.model_cfg)
        check_fp8_device(self.device, self.model_cfg.quant is not None,
                         self.cfg.cache.cache_dtype == "fp8")
        self.offload: OffloadEngine | None = None
        if self.cfg.offload.budget_bytes is None:
            self.model = build_model(self.model_cfg, comm, self.dtype, self.device, ep_comm,
                                     progress, self.cfg.load_format)
            if self.cfg.lora.enabled:  # A rows after W's: in the weights' arena too
                append_slot_rows(self.model, self.cfg.lora)
            self.sleep_memory.take_weights(self.model)  # level-2 sleep can release them
            if self.cfg.lora.enabled:  # before the KV cache is sized around what is in use
                self.lora_slots = slots = LoRASlots(self.model, self.cfg.lora)
                log.info("rank %d: %d LoRA slots of rank %d on %s, %.1f MiB", self.rank,
                         slots.num_slots, slots.rank, ", ".join(slots.stacks),
                         slots.nbytes / 2**20)
        else:  # weights stay in host memory; the engine moves the rest to the device
            self.model = build_model(self.model_cfg, comm, self.dtype, torch.device("cpu"),
                                     ep_comm, progress, self.cfg.load_format)
            self.offload = apply_offload(self.model, self.model.model, self.cfg.offload,
                                         self.device, self._one_token_forward)
            if self.cfg.graph.mode == "graph" and not self.cfg.uses_graphs:
                log.warning("rank %d: offload mode %r moves weights between steps; running "
                            "every step eagerly (no graphs)", self.rank, self.cfg.offload.mode)
        if self.device.type == "cuda":  # offload copies weights in during a step
            from raygraph.model import triton_pdl

            triton_pdl.set_enabled(self.offload is None)
        draft = self.cfg.draft_cfg() if self.samples else None
        if draft is not None:  # before the KV cache is sized around what is in use
            check_fp8_device(self.device, draft.quant is not None, False)
            self.drafter = make_drafter(self.cfg, draft, self.model, self.dtype, self.device)
            self.sleep_memory.take_drafter(self.drafter, self.model)
            # the drafter's time in a step (catch-up, proposal): two, as for the host copies
            self._draft_spans = [Spans(self.device.type == "cuda") for _ in range(2)]
            k = self.cfg.speculative.num_speculative_tokens
            self._host_proposals = [torch.zeros(self.cfg.scheduler.max_num_seqs * k,
                                                dtype=torch.long,
                                                pin_memory=self.device.type == "cuda")
                                    for _ in range(2)]
            log.info("rank %d: %s drafter %s, %.1f MiB", self.rank,
                     self.cfg.speculative.method, draft.path, self.drafter.weight_bytes / 2**20)
        if warmup is not None:
            warmup.join()
        if self.kv_dtype == FP8_KV:  # a checkpoint's per-tensor cache scales (else 1.0)
            for layer in self.model.attention_layers():
                if hasattr(layer, "k_scale"):
                    layer.kv_scale = (layer.k_scale.item(), layer.v_scale.item())
        self.weight_bytes = weight_bytes = sum(p.numel() * p.element_size()
                                               for p in self.model.parameters())
        per_block = self.kv_bytes_per_block()
        num_blocks = self.cfg.cache.num_blocks or max(1, kv_cache_budget(self) // per_block)
        load_s = time.perf_counter() - t0
        log.info("rank %d: loaded %.1f MiB of weights in %.2fs on %s; room for %d KV blocks",
                 self.rank, weight_bytes / 2**20, load_s, self.device, num_blocks)
        return WorkerInfo(self.rank, str(self.device), num_blocks, weight_bytes, per_block, load_s)

    def _groups(self) -> tuple[Comm, Comm | None]:
        """(this rank's TP group, the EP group): TP groups are the DP groups' ranks; EP spans
        the world. Every rank creates every group, in the same order (torch requires it)."""
        p = self.cfg.parallel
        tp_groups = [dist.group.WORLD] if p.dp == 1 else [
            dist.new_group(list(range(d * p.tp, (d + 1) * p.tp))) for d in range(p.dp)]
        tp = Comm(tp_groups[p.dp_rank(self.rank)]) if p.tp > 1 else Comm()
        return tp, Comm(dist.group.WORLD) if p.ep > 1 else None

    def kv_bytes_per_block(self) -> int:
        """The target's K/V of one block, and the draft model's where this rank drafts."""
        draft = self.drafter.bytes_per_block() if self.drafter is not None else 0
        return kv_bytes_per_block(self.cfg, self.model_cfg, self.kv_dtype) + draft

    def _one_token_forward(self) -> None:
        """One eager forward of a single token over a throwaway cache (records the order in
        which an offloaded model reads its weights)."""
        self._bind_kv_cache(1)
        chunk = SeqChunk(0, [0], 0, [0], True)
        # every rank runs the same shape at once, so it is also the EP dispatch size
        plan = StepPlan(-1, [chunk], num_comm_tokens=1)
        EagerExecutor(self.model, self.cfg.cache.block_size).logits(plan)
        self._bind_kv_cache(0)

    def load_lora(self, slot: int, path: str) -> tuple[str, float]:
        """Load a PEFT adapter into `slot` now and wait for it (in-process use; served
        promotions ride on the steps: StepDelta.lora_loads); returns the tier it came from
        ("warm" or "cold") and the seconds it took. Raises LoRAError if it cannot."""
        done = self._load_slot(slot, path)
        if done.error:
            raise LoRAError(done.error)
        if self.device.type == "cuda":  # steps may run on another thread's stream
            torch.cuda.synchronize(self.device)
        return done.tier, done.seconds

    def unload_lora(self, slot: int) -> None:
        """Zero `slot`: a token still naming it would compute the base model."""
        self._slots().clear(slot)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _slots(self) -> LoRASlots:
        if self.lora_slots is None:
            raise LoRAError("LoRA is off (lora.max_loras = 0): no adapter slots")
        return self.lora_slots

    def _load_slot(self, slot: int, path: str) -> LoRALoad:
        """Queue `path`'s slot image into `slot` on this thread's stream, without waiting:
        from the warm tier a few host-to-device copies, else read and cut here first (cold).
        A failure zeroes the slot and is reported, not raised: a step goes on for every
        other request. Every rank of the group loads the same adapter into the same slot."""
        slots = self._slots()
        slots.check(slot)
        t0 = time.perf_counter()
        try:
            image, tier = self.warm_loras.get(path, self._slot_image)
            slots.load(slot, image)
        except Exception as e:  # the files changed since registration, say
            slots.clear(slot)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            return LoRALoad(slot, "cold", time.perf_counter() - t0, f"rank {self.rank}: {reason}")
        return LoRALoad(slot, tier, time.perf_counter() - t0)

    def _slot_image(self, path: str) -> SlotImage:
        lc = self.cfg.lora
        adapter = read_adapter(path, self.model_cfg, lc.max_lora_rank, lc.targets)
        return self._slots().image(adapter, pin=self.device.type == "cuda")

    def offload_stats(self) -> OffloadStats | None:
        """Bytes copied per step, achieved H2D GB/s, stall time, hit rate (None: no offload)."""
        return self.offload.stats() if self.offload is not None else None

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`num_blocks` usable blocks plus one scratch block for padding writes."""
        m = self.model_cfg
        return (num_blocks + 1, self.cfg.cache.block_size,
                m.kv_heads_per_rank(self.cfg.parallel.tp), m.head_dim)

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """A throwaway cache (sizing, offload's order recording): plain device memory."""
        shape = self._kv_shape(num_blocks)
        for layer in self.model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Bind the KV cache and build the executor over it (graphs capture its addresses).
        The cache lives in a VMM arena, so sleep can release it and wake map it back there."""
        t0 = time.perf_counter()
        layers = self.model.attention_layers()
        pairs = self.sleep_memory.kv_cache(self._kv_shape(num_blocks), self.kv_dtype,
                                           len(layers))
        if pairs is None:
            self._bind_kv_cache(num_blocks)
        else:
            for layer, (k, v) in zip(layers, pairs):
                layer.k_cache, layer.v_cache = k, v
        if self.drafter is not None:
            self.drafter.bind_kv(num_blocks, self.sleep_memory.draft_kv_cache(num_blocks))
        t1 = time.perf_counter()
        self.executor = self._make_executor(self.graph_budget)
        t2 = time.perf_counter()
        # every rank here at once: TP gathers. An offloaded model reads its head only after a
        # forward's body (the recorded order) and refuses a warm-up outside one: its first
        # few-row steps pay the compile instead
        if isinstance(self.executor, GraphExecutor) and self.offload is None:
            self.executor.warm_logits()
        if self.drafter is not None and self.cfg.graph.capture == "background":
            self.drafter.capture_on_use = False  # its graphs come with the decode keys'
        elif self.drafter is not None:  # its graphs, before any step could wait for one
            t3 = time.perf_counter()
            n = self.drafter.capture_all(self.executor.prev_tokens)
            if n:
                log.info("rank %d: %d drafter graphs captured in %.2fs", self.rank, n,
                         time.perf_counter() - t3)
        self.kv_cache_bytes = num_blocks * self.kv_bytes_per_block()
        log.info("rank %d: KV cache of %d blocks mapped in %.2fs, executor built in %.2fs, "
                 "logits warmed in %.2fs", self.rank, num_blocks, t1 - t0, t2 - t1,
                 time.perf_counter() - t2)
        return self.kv_cache_bytes

    def _make_executor(self, graph_budget: int | None, pool: str | None = None) -> Executor:
        """The executor the config asks for (`pool` overrides the graph pool: benchmarks)."""
        g = self.cfg.executor_graph()
        if pool is not None:
            g = msgspec.structs.replace(g, pool=pool)
        return make_executor(g, bucket_plan(self.cfg), self.model, self.cfg.cache.block_size,
                             self.cfg.scheduler.max_num_seqs,
                             self.cfg.max_model_len(self.model_cfg), graph_budget, self.rank)

    def memory_stats(self) -> MemoryStats:
        """Weights, KV cache, input buffers and graph pool; also logged (call it after the
        capture schedule)."""
        ex = self.executor
        ex.log_memory()
        return MemoryStats(
            rank=self.rank, device=str(self.device),
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.kv_cache_bytes,
            input_buffer_bytes=ex.input_buffer_bytes,
            graph=ex.pool_stats(),
            **self.sleep_memory.stats(),
        )

    def sleep(self, level: int = 1) -> SleepStats:
        """Release the graph pool and the KV cache (level 1), and the weights (level 2, kept
        in host memory); graphs stay captured (a drafter's are dropped: worker/sleep.py). No
        step may be in flight or sent until wake."""
        return self.sleep_memory.sleep(level, self.executor)

    def wake_up(self) -> SleepStats:
        """Map fresh physical memory at the same addresses: graphs replay, no recapture
        (but a drafter's few graphs).
        A staged wake (cache.staged_wake) maps the KV cache's first blocks only (the reply's
        kv_blocks_ready) and the rest in the background: no step may use a block past
        kv_blocks_ready()."""
        stats = self.sleep_memory.wake_up(self.executor, self.cfg.cache)
        if stats.weight_bytes and self.lora_slots is not None:
            self.lora_slots.restore()  # the arena restores A rows as they were at 1st sleep
        return stats

    def kv_blocks_ready(self) -> int:
        """n: KV blocks [0, n) may be used (all but during a staged wake); raises KVMapError
        if the background mapping failed."""
        return self.sleep_memory.kv_blocks_ready()

    def capture_all(self) -> list[CaptureRecord]:
        """Capture the whole schedule alone, for in-process use (benchmarks, one GPU).
        Served workers capture key by key in lockstep (`prepare_capture`, `capture`)."""
        records = self.executor.capture_all()
        if self.drafter is not None:
            self.drafter.capture_all(self.executor.prev_tokens)
        return records

    def prepare_capture(self, key: BucketKey) -> None:
        """The barrier before a lockstep capture: refuse a key outside this rank's own
        schedule before any collective is issued, so a disagreement is an error, not a hang."""
        self._maybe_fault("prepare", key)
        self.sleep_memory.check_awake()
        if not self.executor.allows(key):
            raise KeyMismatch(f"rank {self.rank}: {key} is not in this rank's capture schedule")

    def capture(self, key: BucketKey) -> CaptureRecord:
        """Capture one key; every rank of the group is capturing the same key right now. A
        decode key brings the drafter's graphs of as many rows along."""
        self._maybe_fault("capture", key)
        self.sleep_memory.check_awake()
        record = self.executor.capture(key)
        if self.drafter is not None and key.phase == "decode":
            # the largest decode key brings every size (max_decode may be below max_num_seqs)
            top = max((k.num_tokens for k in self.executor.schedule() if k.phase == "decode"),
                      default=key.num_tokens)
            rows = self.drafter.max_seqs if key.num_tokens >= top else key.num_tokens
            self.drafter.capture_upto(rows, self.executor.prev_tokens)
        return record

    def inject_fault(self, kind: str, phase: str = "capture", key: BucketKey | None = None) -> None:
        """Fault injection for tests and drills: at `phase` ("prepare" | "capture" of `key`,
        any key if None; "step": the next served step) this rank raises ("raise"), exits
        ("exit") or stalls ("stall")."""
        if kind not in ("raise", "exit", "stall"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self._fault = (kind, phase, key)

    def _maybe_fault(self, phase: str, key: BucketKey) -> None:
        if self._fault is None:
            return
        kind, at_phase, at_key = self._fault
        if at_phase != phase or at_key not in (None, key):
            return
        if kind == "raise":
            raise RuntimeError(f"rank {self.rank}: injected fault at {phase} of {key}")
        if kind == "exit":
            os._exit(1)
        time.sleep(3600)

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step to the end (in-process use, tests); the group's first TP rank returns
        the tokens, other ranks None. Served steps come through `run`."""
        t0 = time.perf_counter()
        tokens, _, _, _ = self._launch(plan)
        out = tokens.tolist() if tokens is not None and self.samples else []
        if self.offload is not None:
            self.offload.note_step(time.perf_counter() - t0)
        return StepResult(plan.step_id, out, time.perf_counter() - t0) if self.samples else None

    def _launch(self, plan: StepPlan, before_masks: Callable[[], None] | None = None,
                draft: Spans | None = None
                ) -> tuple[torch.Tensor | None, Logprobs | None, list[tuple[int, int]],
                           torch.Tensor | None]:
        """Queue one step on the device; its sampled tokens [S] stay there, in the buffer the
        next step's fed tokens read. Every TP rank samples: their logits are bitwise equal
        and their generators advance alike, so they draw the same tokens. The sampling rank
        also computes logprobs when a row asked (None otherwise: no work at all). Rows
        under a grammar sample within its mask, filled once the forward is queued, after
        `before_masks` (which reads the previous step's tokens: worker/guides.py); their
        (row, seq id) come back third. Fourth, when a chunk verifies drafts: the greedy
        token of every logits row (worker/speculative.py); None otherwise. `draft` times the
        drafter's pass before the step."""
        self.sleep_memory.check_awake()
        if self.drafter is not None:  # ahead of the step: it reads the tokens fed, and its
            # inputs' upload is then ordered before the step's (the next one need not wait)
            with draft.span() if draft is not None else nullcontext():
                self.drafter.catch_up(plan, self.executor.prev_tokens)
        try:
            logits, greedy = self.executor.step(plan)
        except KeyMismatch as e:
            raise KeyMismatch(f"rank {self.rank}: {e}") from None
        chunks = [s for s in plan.seqs if s.sample]
        if not chunks:
            return None, None, [], None
        targets = None
        if any(c.verify for c in chunks):
            every_row = logits
            logits, greedy, targets = last_rows(chunks, logits, greedy,
                                                self._host_rows[plan.step_id % 2])
            targets = sampled_targets(chunks, every_row, targets,
                                      self._host_drafts[plan.step_id % 2], self.generator)
        guided, masks = self.guides.rows(chunks), None
        if guided:
            if before_masks is not None:
                before_masks()
            masks = self.guides.masks(guided, logits.shape[-1])
        tokens = sample_tokens(logits, chunks, self.generator, greedy, self._sampling, masks)
        self.executor.prev_tokens[: len(chunks)].copy_(tokens)
        rows = logprob_rows(chunks) if self.samples and self.state.logprob_seqs else None
        if not rows:
            return tokens, None, guided, targets
        k = max(chunks[i].logprobs for i in rows)
        return tokens, (token_logprobs(logits, tokens, k), rows, chunks), guided, targets

    # ---- the served path: the coordinator's compiled graph calls only this ----------------
    def run(self, cmd: bytes | WorkerCall) -> bytes | object:
        """A step (msgpack StepDelta), a flush (b""), or a method call (WorkerCall).

        Steps are pipelined: the reply to step N carries step N-1's tokens, read once N is
        queued, so the device goes from N-1 to N while the host learns N-1's tokens and the
        coordinator schedules N+1. A flush returns the last step's tokens.
        """
        if not self._frozen:
            # start-up is over: its objects (model, graphs, records) need no more
            # collecting, and a full collection over them stalls a step by tens of ms
            freeze_heap()
            self._frozen = True
        if self.device.type == "cuda" and threading.get_ident() != self._thread:
            # Ray runs the compiled graph's loop on its own thread: the driver calls of the
            # input upload need this device's context current there
            torch.cuda.set_device(self.device)
            self._thread = threading.get_ident()
            self._thread_switches += 1
            if self._thread_switches <= 3:  # per-thread state (cuDNN plans) starts over
                log.info("rank %d: steps now run on thread %#x (switch %d)", self.rank,
                         self._thread, self._thread_switches)
        if isinstance(cmd, WorkerCall):
            if self._pending is not None:
                raise StateError(f"rank {self.rank}: {cmd.method} called with a step in "
                                 "flight (flush first)")
            if cmd.rank >= 0 and cmd.rank != self.rank:
                return None
            if cmd.method not in WORKER_CALLS:
                raise StateError(f"rank {self.rank}: {cmd.method!r} cannot be called remotely")
            try:
                return getattr(self, cmd.method)(*cmd.args)
            except Exception as e:  # the coordinator sees one error for the group: name us
                if str(e).startswith(f"rank {self.rank}:"):
                    raise
                raise RuntimeError(f"rank {self.rank}: {type(e).__name__}: {e}") from e
        if not cmd:
            return self._collect()
        pending = _Pending(-1, time.perf_counter())
        cuda = self.device.type == "cuda"
        if cuda and self.samples:
            pending.start = torch.cuda.Event(enable_timing=True)
            pending.start.record()
        delta = DELTA.decode(cmd)
        pending.step_id = delta.step_id
        self._maybe_fault("step", None)
        loads = [self._load_slot(slot, path) for slot, path in delta.lora_loads]
        plan = self.state.apply(delta)
        self.guides.apply(delta)
        early: list[bytes | None] = []  # the previous step's reply, read before the masks
        if self.drafter is not None:
            pending.draft = self._draft_spans[delta.step_id % 2].reset()
        tokens, logprobs, guided, targets = self._launch(
            plan, lambda: early.append(self._collect(loads)), pending.draft)
        pending.guided = guided
        if tokens is not None and (self.samples or guided):
            pending.tokens = self._host_tokens[delta.step_id % 2][: len(tokens)]
            pending.tokens.copy_(tokens, non_blocking=True)
        verifying = targets is not None and self.samples
        sampling = ([s for s in plan.seqs if s.sample]
                    if verifying or self.drafter is not None else [])
        if verifying:
            pending.verify = verify_rows(sampling)
            pending.targets = self._host_targets[delta.step_id % 2][: len(targets)]
            pending.targets.copy_(targets, non_blocking=True)
        if self.drafter is not None:
            with pending.draft.span():
                proposal = self.drafter.propose(sampling, tokens, targets)
            if proposal is not None:
                pending.proposing, drafts = proposal
                host = self._host_proposals[delta.step_id % 2][: drafts.numel()]
                pending.drafts = host.view(drafts.shape).copy_(drafts, non_blocking=True)
        if cuda and guided and not self.samples:
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        if self.samples:
            if logprobs is not None:
                packed, rows, chunks = logprobs
                host = torch.empty(packed.shape, pin_memory=cuda).copy_(packed,
                                                                       non_blocking=True)
                pending.logprobs = (host, rows, chunks)
            if cuda:
                pending.ready = torch.cuda.Event(enable_timing=True)
                pending.ready.record()
                pending.after, self._last_ready = self._last_ready, pending.ready
            else:
                pending.seconds = time.perf_counter() - pending.started
        out = early[0] if early else self._collect(loads)
        self._pending = pending
        return out

    def _collect(self, loads: list[LoRALoad] | None = None) -> bytes | None:
        """The pending step's tokens, once the device has them (msgpack StepOutput), with
        `loads`: those of the step just launched (a rank that does not sample answers only
        when there are some)."""
        p, self._pending = self._pending, None
        if p is not None and p.ready is not None:
            p.ready.synchronize()
        tokens = p.tokens.tolist() if p is not None and p.tokens is not None else []
        if p is not None and p.guided:
            self.guides.accept(p.guided, tokens)
        if not self.samples:
            return OUTPUT.encode(StepOutput(-1, [], lora_loads=loads)) if loads else None
        if p is None:
            return OUTPUT.encode(StepOutput(-1, [], lora_loads=loads or []))
        if p.ready is not None:
            p.seconds = p.start.elapsed_time(p.ready) / 1e3
            if p.after is not None:  # the device's wait between the two steps
                p.idle = max(0.0, p.after.elapsed_time(p.start) / 1e3)
        if self.offload is not None:
            self.offload.note_step(p.seconds)
        logprobs = {}
        if p.logprobs is not None:
            packed, rows, chunks = p.logprobs
            logprobs = unpack_logprobs(packed.tolist(), rows, chunks)
        counts: list[int] = []
        if p.verify:
            tokens, counts = emitted(tokens, p.targets.tolist(), p.verify)
        drafts = dict(zip(p.proposing, p.drafts.tolist())) if p.proposing else {}
        draft_s = p.draft.seconds() if p.draft is not None else 0.0
        return OUTPUT.encode(StepOutput(p.step_id, tokens, p.seconds, p.idle, logprobs,
                                        loads or [], counts, drafts, draft_s))

    def logits(self, plan: StepPlan) -> torch.Tensor:
        """This rank's float32 logits for a plan, on the CPU: for checks across ranks/modes."""
        self.sleep_memory.check_awake()
        return self.executor.logits(plan).cpu()

    def time_steps(self, plans: list[StepPlan]) -> list[float]:
        """Run plans back to back, each ending in a host read; seconds per step. Every rank
        of the group must be given the same plans at once (their collectives pair up)."""
        times = []
        for plan in plans:
            t0 = time.perf_counter()
            self.execute(plan)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def shutdown(self) -> None:
        if hasattr(self, "executor"):
            self.executor.release()
        if dist.is_initialized():
            dist.destroy_process_group()
