"""The coordinator: a named async Ray actor that owns the scheduler and drives the workers.

Clients call `generate` (or `generate_stream`) concurrently; one step loop batches all
requests, sends each StepPlan to every worker and applies rank 0's sampled tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raygraph import setup_logging
from raygraph.cluster.lockstep import CaptureError, KeyReport, LockstepCapture
from raygraph.cluster.requests import (
    BadRequest,
    Detokenizer,
    encode_prompt,
    load_tokenizer,
    parse_params,
    split_prompts,
)
from raygraph.cluster.scheduler import Scheduler, SchedulerOutput, Sequence
from raygraph.config import ModelConfig, ServeConfig
from raygraph.graph.buckets import BucketPlan
from raygraph.memory.pages import BlockPool
from raygraph.memory.stats import MemoryStats
from raygraph.protocol import (
    BucketKey,
    GenerateResult,
    StartupProgress,
    StepPlan,
    StreamDelta,
    WorkerInfo,
)
from raygraph.worker.worker import Worker

log = logging.getLogger("raygraph.coordinator")

# Passed to every worker: NVLink multicast must stay off on shared hosts.
FORWARDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                 "RAYGRAPH_CPU_THREADS", "PYTHONPATH")


class WorkerFailure(RuntimeError):
    """A worker died or failed a step; the requests in flight were failed with this."""


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer
    group: int  # the DP group that serves it
    deltas: asyncio.Queue[StreamDelta] = field(default_factory=asyncio.Queue)
    error: str | None = None


class Coordinator:
    def __init__(self, cfg: ServeConfig) -> None:
        setup_logging()
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_pretrained(cfg.model)
        cfg.parallel.check_model(self.model_cfg)
        self.tokenizer = load_tokenizer(cfg.model)
        self.workers: list[Any] = []
        self.pg = None
        self.infos: list[WorkerInfo] = []
        self.schedulers: list[Scheduler] = []  # one per DP group, each with its own KV pool
        self.requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.healthy = False
        self.unhealthy_reason: str | None = None
        self.recovering = False
        self._serving = asyncio.Event()  # set while healthy; requests wait on it in recovery
        self.restarts = 0
        self.steps = 0
        self.tokens_generated = 0
        self.preemptions = 0
        self.forward_s = 0.0  # rank 0's time inside Worker.execute, summed over steps
        self.capture_s = 0.0
        graph = cfg.uses_graphs
        s = cfg.scheduler
        self.ep = cfg.parallel.ep > 1
        self.buckets = (BucketPlan.from_config(cfg.graph, s.max_num_seqs,
                                               s.max_num_batched_tokens, self.ep)
                        if graph else None)
        self.lockstep: LockstepCapture | None = None
        self.memory: list[MemoryStats] = []  # per rank, after the capture schedule
        self._progress = StartupProgress()

    # ---- start-up -------------------------------------------------------------------
    async def start(self) -> dict:
        """Place and start the workers, load the model, size the KV cache, start the loop."""
        t0 = time.perf_counter()
        await self._start_workers()
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        self.healthy = True
        self._serving.set()
        log.info("coordinator ready in %.1fs: %s", time.perf_counter() - t0, self.describe())
        return self.describe()

    async def _start_workers(self) -> None:
        cfg = self.cfg
        world = cfg.parallel.world_size
        gpu = cfg.device == "cuda"
        bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(world)]
        self.pg = placement_group(bundles, strategy="STRICT_PACK")
        try:
            await asyncio.wait_for(self.pg.ready(), timeout=60)
        except asyncio.TimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"could not place {world} workers ({bundles[0]} each) within 60 s; "
                f"cluster resources: {ray.cluster_resources()}"
            ) from None
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        actor = ray.remote(Worker)
        self.workers = [
            actor.options(
                num_cpus=1, num_gpus=1 if gpu else 0, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i),
            ).remote(cfg, i)
            for i in range(world)
        ]
        addr = await self.workers[0].address.remote()
        log.info("loading %s on %d %s worker(s) (tp=%d)", cfg.model, world, cfg.device,
                 cfg.parallel.tp)
        me = ray.get_runtime_context().current_actor
        self.infos = await asyncio.gather(*(w.load.remote(addr, me if r == 0 else None)
                                            for r, w in enumerate(self.workers)))
        num_blocks = min(i.num_kv_blocks for i in self.infos)
        await asyncio.gather(*(w.allocate_kv_cache.remote(num_blocks) for w in self.workers))
        self.lockstep = LockstepCapture(self.workers, cfg.graph.capture_timeout_s)
        if self.buckets is not None and cfg.graph.capture_at_start:
            await self.capture_schedule()
        bs = cfg.cache.block_size
        limit = cfg.scheduler.max_model_len or self.model_cfg.max_position_embeddings
        max_model_len = min(limit, self.model_cfg.max_position_embeddings, num_blocks * bs)
        self.schedulers = [
            Scheduler(BlockPool(num_blocks, bs), cfg.scheduler.max_num_seqs,
                      cfg.scheduler.max_num_batched_tokens, max_model_len,
                      self.model_cfg.eos_token_ids)
            for _ in range(cfg.parallel.dp)
        ]

    async def capture_schedule(self) -> list[KeyReport]:
        """Capture the whole schedule in lockstep, largest first; returns the per-key table.

        On any disagreement, failure or stall the worker group is torn down (a rank may be
        blocked in a collective) and CaptureError names the key and rank; `start()` may then
        be called again.
        """
        if self.lockstep is None or self.buckets is None:
            raise RuntimeError("no graph-mode worker group to capture on")
        keys = self.buckets.schedule()
        t0 = time.perf_counter()
        for i, key in enumerate(keys, 1):
            if key not in self.lockstep.captured:
                r = await self._capture_key(key)
                log.debug("capture %d/%d %s: ranks agree, %d graph(s), %s nodes, "
                          "%d collectives, %.1f MiB, %.2fs", i, len(keys), key, r.pieces,
                          r.nodes, r.collectives, r.pool_bytes / 2**20, r.seconds)
            self._progress = msgspec.structs.replace(self._progress, capture=(i, len(keys)))
        self.capture_s += time.perf_counter() - t0
        self.memory = await asyncio.gather(*(w.memory_stats.remote() for w in self.workers))
        reports = self.lockstep.reports
        graphs = sum(r.pieces for r in reports)
        if graphs:
            log.info("capture schedule: %d buckets, %d graphs, %.1f MiB of graph pool in %.2fs",
                     len(reports), graphs, sum(r.pool_bytes for r in reports) / 2**20,
                     self.capture_s)
        else:  # the eager backend (CPU): the protocol ran, nothing was captured
            log.info("capture schedule: %d keys checked in lockstep in %.2fs (eager backend: "
                     "no graphs)", len(reports), self.capture_s)
        return reports

    async def _capture_key(self, key: BucketKey) -> KeyReport:
        try:
            return await self.lockstep.capture(key)
        except CaptureError as e:
            log.error("%s; stopping the worker group", e)
            self.healthy = False
            self.unhealthy_reason = str(e)
            self._serving.clear()
            await self._stop_workers()
            raise

    def report_progress(self, phase: str, done: int, total: int) -> None:
        """Workers report start-up progress here (rank 0's weight load)."""
        self._progress = msgspec.structs.replace(self._progress, **{phase: (done, total)})

    def progress(self) -> StartupProgress:
        return self._progress

    def capture_report(self) -> list[KeyReport]:
        """The per-key capture table so far (also after a failed capture)."""
        return list(self.lockstep.reports) if self.lockstep else []

    def _plans(self, step: int, outs: list[SchedulerOutput | None]) -> list[StepPlan]:
        """One plan per DP group, keyed. An idle group runs one padding token, so the MoE
        collectives still match; under EP every group pads to the same dispatch size."""
        # decode: one token per chunk (every chunk has at least one)
        shapes = [(o.plan.num_tokens, len(o.plan.seqs), o.plan.num_tokens == len(o.plan.seqs))
                  if o else (1, 1, True) for o in outs]
        if self.buckets is None:  # eager mode: the dispatch size is the largest real batch
            comm = max(t for t, _, _ in shapes) if self.ep else 0
            keys = [None] * len(outs)
        else:
            comm = self.buckets.comm_tokens(shapes) if self.ep else 0
            keys = [self.buckets.key(t, n, d, comm) for t, n, d in shapes]
        return [StepPlan(step, o.plan.seqs if o else [], key=k, num_comm_tokens=comm)
                for o, k in zip(outs, keys)]

    def describe(self) -> dict:
        reports = self.capture_report()
        return {
            "model": self.cfg.model, "device": self.cfg.device, "dtype": self.cfg.dtype,
            "tp": self.cfg.parallel.tp, "healthy": self.healthy,
            "dp": self.cfg.parallel.dp, "ep": self.cfg.parallel.ep,
            "num_kv_blocks": self.schedulers[0].pool.num_blocks if self.schedulers else 0,
            "max_model_len": self.schedulers[0].max_model_len if self.schedulers else 0,
            "weight_bytes_per_rank": [i.weight_bytes for i in self.infos],
            "graph_mode": self.cfg.graph.mode, "buckets_captured": len(reports),
            "graphs_captured": sum(r.pieces for r in reports),
            "capture_s": round(self.capture_s, 2),
            "graph_pool_bytes": sum(r.pool_bytes for r in reports),
            "graph_memory_bytes": [m.graph.held_bytes if m.graph else 0 for m in self.memory],
        }

    def stats(self) -> dict:
        ss = self.schedulers
        return {
            "healthy": self.healthy, "reason": self.unhealthy_reason, "steps": self.steps,
            "restarts": self.restarts,
            "tokens_generated": self.tokens_generated, "preemptions": self.preemptions,
            "worker_step_ms": round(1e3 * self.forward_s / max(1, self.steps), 3),
            "running": sum(len(s.running) for s in ss), "waiting": sum(len(s.waiting) for s in ss),
            "kv_utilization": max((s.pool.utilization for s in ss), default=0.0),
        }

    async def worker_stats(self) -> list[dict]:
        """Per rank: memory (weights, KV, input buffers, graph pool) and, when weights are
        offloaded, the offload engine's copy figures."""
        mem, off = await asyncio.gather(
            asyncio.gather(*(w.memory_stats.remote() for w in self.workers)),
            asyncio.gather(*(w.offload_stats.remote() for w in self.workers)))
        return [{"memory": msgspec.to_builtins(m), "offload": msgspec.to_builtins(o)}
                for m, o in zip(mem, off)]

    # ---- client API -------------------------------------------------------------------
    async def generate(self, prompts: Any, params: Any = None) -> list[GenerateResult]:
        """Generate for one prompt or a list (text or token ids); results in input order.

        Bad input raises BadRequest before anything is scheduled; other requests go on.
        """
        await self._wait_serving()
        reqs = self._submit(prompts, params)
        return list(await asyncio.gather(*(self._collect(r) for r in reqs)))

    async def generate_stream(self, prompt: Any, params: Any = None) -> AsyncIterator[StreamDelta]:
        """Yield each step's new tokens for one prompt; the last delta has finish_reason.

        Call as `coordinator.generate_stream.options(num_returns="streaming").remote(...)`.
        """
        await self._wait_serving()
        (req,) = self._submit(prompt, params, single=True)
        while True:
            delta = await req.deltas.get()
            yield delta
            if delta.finish_reason is not None:
                if req.error:
                    raise WorkerFailure(req.error)
                return

    async def _wait_serving(self) -> None:
        """While the worker group restarts, new requests wait for it instead of failing."""
        if self.recovering:
            try:
                await asyncio.wait_for(self._serving.wait(), timeout=self.cfg.step_timeout_s)
            except asyncio.TimeoutError:
                pass  # _submit reports why

    def _submit(self, prompts: Any, params: Any, single: bool = False) -> list[_Request]:
        if not self.healthy or not self.schedulers:
            reason = self.unhealthy_reason or "not started"
            raise WorkerFailure(f"coordinator is not serving: {reason}")
        sp = parse_params(params)
        items = [prompts] if single else split_prompts(prompts)
        m = self.model_cfg
        encoded = [encode_prompt(p, self.tokenizer, m.vocab_size, m.bos_token_id) for p in items]
        for ids in encoded:  # all checked before any is queued
            try:
                self.schedulers[0].check_prompt(len(ids))
            except ValueError as e:
                raise BadRequest(str(e)) from None
        reqs = []
        for ids in encoded:
            seq = Sequence(next(self._ids), ids, sp)
            group = min(range(len(self.schedulers)), key=self._load)  # least-loaded DP group
            req = _Request(seq, Detokenizer(self.tokenizer, sp.stop), group)
            self.schedulers[group].add(seq)
            self.requests[seq.seq_id] = req
            reqs.append(req)
        self._wake.set()
        return reqs

    def _load(self, group: int) -> int:
        s = self.schedulers[group]
        return len(s.running) + len(s.waiting)

    async def _collect(self, req: _Request) -> GenerateResult:
        while True:
            delta = await req.deltas.get()
            if delta.finish_reason is not None:
                break
        if req.error:
            raise WorkerFailure(req.error)
        seq = req.seq
        return GenerateResult(
            seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids),
            req.detok.text if self.tokenizer else None, seq.finish_reason,
        )

    # ---- the step loop ----------------------------------------------------------------
    async def _step_loop(self) -> None:
        while True:
            outs = [s.schedule() for s in self.schedulers] if self.healthy else []
            if all(o is None for o in outs):
                self._wake.clear()
                await self._wake.wait()
                continue
            step = self.steps
            plans = self._plans(step, outs)
            par = self.cfg.parallel
            try:
                for key in dict.fromkeys(p.key for p in plans):  # new shapes: all ranks at once
                    if key is not None and key.phase != "eager" \
                            and key not in self.lockstep.captured:
                        await self._capture_key(key)
                results = await asyncio.wait_for(
                    asyncio.gather(*(w.execute.remote(plans[par.dp_rank(r)])
                                     for r, w in enumerate(self.workers))),
                    timeout=self.cfg.step_timeout_s,
                )
            except Exception as e:  # actor death, a raised step, a hang past the timeout
                await self._on_failure(step, e)
                continue
            self.steps += 1
            self.forward_s += results[0].forward_s
            for group, out in enumerate(outs):
                if out is not None:
                    self.preemptions += len(out.preempted)
                    tokens = results[group * par.tp].token_ids  # its TP rank 0 sampled
                    for seq, _ in self.schedulers[group].update(out, tokens):
                        self._emit(seq)

    def _emit(self, seq: Sequence) -> None:
        req = self.requests[seq.seq_id]
        self.tokens_generated += 1
        text, stopped = req.detok.update(seq.output_token_ids)
        if stopped:
            self.schedulers[req.group].finish(seq, "stop")
        reason = seq.finish_reason
        req.deltas.put_nowait(StreamDelta(
            seq.seq_id, [seq.output_token_ids[-1]], text if self.tokenizer else None, reason,
        ))
        if reason is not None:
            del self.requests[seq.seq_id]

    async def _on_failure(self, step: int, e: BaseException) -> None:
        """Fail every request in flight, then restart the worker group."""
        msg = f"step {step} failed on a worker: {type(e).__name__}: {e}"
        log.error(msg)
        self.healthy = False
        self.recovering = True
        self._serving.clear()
        self.unhealthy_reason = msg
        for req in self.requests.values():
            req.error = msg
            req.seq.finish_reason = "error"
            req.deltas.put_nowait(StreamDelta(req.seq.seq_id, [], None, "error"))
        self.requests.clear()
        await self._stop_workers()
        try:
            await self._start_workers()
            self.healthy = True
            self.unhealthy_reason = None
            self.restarts += 1
            self._serving.set()
            log.info("worker group restarted after failure")
        except Exception as restart_error:
            self.unhealthy_reason = f"{msg}; restart failed: {restart_error}"
            log.error(self.unhealthy_reason)
        finally:
            self.recovering = False

    async def _stop_workers(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await self._stop_workers()
        self.healthy = False
        self.unhealthy_reason = "shut down"

    def ping(self) -> bool:
        return True

    def worker_handles(self) -> list[Any]:
        """The worker actors, for fault-injection tests and debugging."""
        return list(self.workers)


__all__ = ["BadRequest", "Coordinator", "WorkerFailure"]
