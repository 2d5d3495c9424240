"""The engine: one replica, an async Ray actor that owns its schedulers and drives its worker
group. The coordinator starts one per replica, placed with its workers.

Requests arrive on the actor's event loop (`generate` and `generate_stream` from the
coordinator; `submit_streams` from HTTP servers directly, their deltas sent back over each
server's delta channel, raygraph/channel.py, so a token goes from here to its client in
one hop). The step loop runs on its own thread and does only the
step (engine/core.py): drain new requests, schedule, send the deltas over the compiled graph
(engine/group.py), apply the tokens of the step before. Detokenization, stop strings and
stream fan-out run on the event loop, beside it.

Over 500 lines because it is one actor's whole surface and the wiring of its two threads;
the logic behind it lives in core.py (the step), capture.py, sleep.py, lora.py and
requests.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import ray

from raygraph.channel import ChannelAddress, DeltaChannel
from raygraph.config import ServeConfig
from raygraph.engine.capture import Capture
from raygraph.engine.core import EngineCore
from raygraph.engine.drafts import ModelDrafts
from raygraph.engine.group import WorkerGroup
from raygraph.engine.kv_cache import merge_stats
from raygraph.engine.lockstep import CaptureError, KeyReport, remote_call_all
from raygraph.engine.lora import LoRAAdmission, LoRARegistry
from raygraph.engine.ngram import NgramIndex
from raygraph.engine.requests import Request, RequestTable
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.engine.sleep import KV_POLL_S, SleepControl
from raygraph.errors import (
    BadRequest,
    LoRAError,
    UnknownAdapter,
    WorkerFailure,
    failure,
    last_line,
)
from raygraph.generation import sampling_defaults
from raygraph.grammar import LazyGrammars, structured_of
from raygraph.process import freeze_heap, setup_logging
from raygraph.protocol import (
    REPLICA_SHIFT,
    BucketKey,
    GenerateResult,
    SamplingParams,
    StartupProgress,
    StepOutput,
    StreamDelta,
    StructuredOutputs,
    WorkerInfo,
)
from raygraph.requests import (
    encode_prompt,
    parse_params,
    split_prompts,
    take_deltas,
)
from raygraph.tokenizer import TextTokenizer, load_tokenizer

log = logging.getLogger("raygraph.engine")


class Engine:
    def __init__(self, cfg: ServeConfig, replica: int, pg: Any) -> None:
        """`pg`: the replica's placement group (engine/group.place_workers), which its
        owner, the coordinator, creates and removes."""
        setup_logging()
        # the step thread and the event loop share the GIL: hand it over every 0.5 ms, not
        # Python's default 5 ms, so a busy loop never holds a step back for long
        sys.setswitchinterval(5e-4)
        self.cfg = cfg
        self.replica = replica
        self.pg = pg
        self.model_cfg = cfg.model_cfg()
        cfg.parallel.check_model(self.model_cfg)
        self.tokenizer: TextTokenizer | None = None
        self.grammars = LazyGrammars(lambda: self.tokenizer)  # structured outputs
        self.sampling_defaults = sampling_defaults(cfg.model)  # generation_config.json
        self.workers: list[Any] = []
        self.infos: list[WorkerInfo] = []
        self.schedulers: list[Scheduler] = []  # one per DP group, each with its own KV pool
        self.core: EngineCore | None = None
        self.group: WorkerGroup | None = None
        self.clients = RequestTable(self.tokenizer, self._finish_on_stop_string)
        self.sleeper = SleepControl(lambda: len(self.clients.requests), self._on_step_thread,
                                    self._call, offload=cfg.offload.budget_bytes is not None,
                                    forget_kv=lambda: [s.kv.clear() for s in self.schedulers],
                                    pools=lambda: [s.pool for s in self.schedulers])
        self.lora = self._lora_admission() if cfg.lora.enabled else None
        self._ids = itertools.count(replica << REPLICA_SHIFT)  # request ids name their replica
        # sequences with smaller ids were failed with a worker group (_fail_in_flight)
        self._stale_below = 0
        self.subscribers = DeltaChannel(self._unsubscribed)  # streams' deltas, per process
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # event loop -> step thread
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.healthy = False
        self.unhealthy_reason: str | None = None
        self.recovering = False
        self.restarts = 0
        self.steps = 0
        self.tokens_generated = 0
        self.forward_s = 0.0  # rank 0's time per step in the worker, summed over steps
        self.idle_s = 0.0  # rank 0's device waiting for the next step, summed
        self.draft_s = 0.0  # rank 0's drafter time (speculative decoding), summed
        self.verify_s = 0.0  # rank 0's time in steps that verified drafts, summed
        self.wait_s = 0.0  # the step thread waiting for the workers' replies, summed
        self.loop_s = 0.0  # the step thread's time in steps, waits included
        self.capture: Capture | None = None  # with the worker group
        self._progress = StartupProgress()
        self._stopped = asyncio.Event()
        self._active_at = time.monotonic()  # the last request's arrival
        self._idle_task: asyncio.Task | None = None

    # ---- start-up -------------------------------------------------------------------
    async def start(self) -> dict:
        """Place and start the workers, load the model, size the KV cache, start the loop."""
        t0 = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        starting = asyncio.ensure_future(self._start_workers())
        # transformers takes seconds to import: the tokenizer loads while the workers start,
        # from once their actors are created (the task's first await), so the two imports
        # do not hold back the workers' creation by sharing this process's GIL
        await asyncio.sleep(0)
        loader = concurrent.futures.ThreadPoolExecutor(1)
        tokenizer = loader.submit(load_tokenizer, self.cfg.tokenizer or self.cfg.model)
        loader.shutdown(wait=False)
        await starting
        self.tokenizer = self.clients.tokenizer = await asyncio.wrap_future(tokenizer)
        if self._thread is None:
            self._thread = threading.Thread(target=self._step_thread, name="raygraph-steps",
                                            daemon=True)
            self._thread.start()
        self.healthy = True
        self.unhealthy_reason = None
        self._wake.set()  # a background capture starts at once, traffic or not
        if self.replica >= self.cfg.replica.awake and self._idle_task is None:
            self._idle_task = self.loop.create_task(self._sleep_when_idle())
        freeze_heap()
        log.info("replica %d ready in %.1fs: %s", self.replica, time.perf_counter() - t0,
                 self.describe())
        return self.describe()

    async def _start_workers(self) -> None:
        cfg = self.cfg
        me = ray.get_runtime_context().current_actor
        self.group, self.infos = await WorkerGroup.start(cfg, self.pg, reporter=me)
        self.workers = self.group.workers
        num_blocks = min(i.num_kv_blocks for i in self.infos)
        await asyncio.gather(*(w.allocate_kv_cache.remote(num_blocks) for w in self.workers))
        self.capture = Capture(cfg, self._capture_call, self._capture_failed,
                               lambda: self._call("memory_stats"))
        if self.capture.buckets is not None and cfg.graph.capture == "at_start":
            await asyncio.to_thread(self._capture_schedule)
        self.core = EngineCore.from_config(cfg, self.model_cfg, num_blocks, self.capture,
                                           self.lora)
        self.schedulers = self.core.schedulers

    def _call(self, method: str, *args: Any) -> list[Any]:
        """A worker method on every rank, from the step thread (or before it runs)."""
        if self.group is not None and self.group.compiled:
            return self.group.call(method, *args, timeout=self.cfg.step_timeout_s)
        return ray.get([getattr(w, method).remote(*args) for w in self.workers],
                       timeout=self.cfg.step_timeout_s)

    async def _on_step_thread(self, fn: Callable[[], Any]) -> Any:
        """Run fn where the workers may be called: on the step thread, between steps (it
        owns the compiled graph), or on a helper thread before the loop starts."""
        if self._thread is None or not self._thread.is_alive():
            return await asyncio.to_thread(fn)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def report_progress(self, phase: str, done: int, total: int) -> None:
        """Workers report start-up progress here (rank 0's weight load)."""
        self._progress = msgspec.structs.replace(self._progress, **{phase: (done, total)})

    def progress(self) -> StartupProgress:
        return self._progress

    def describe(self) -> dict:
        reports = self.capture_report()
        cap = self.capture
        return {
            "model": self.cfg.model, "tokenizer": self.cfg.tokenizer or self.cfg.model,
            "device": self.cfg.device, "dtype": self.cfg.dtype,
            "vocab_size": self.model_cfg.vocab_size,
            "tp": self.cfg.parallel.tp, "healthy": self.healthy,
            "dp": self.cfg.parallel.dp, "ep": self.cfg.parallel.ep,
            "num_kv_blocks": self.schedulers[0].pool.num_pages if self.schedulers else 0,
            "max_model_len": self.schedulers[0].max_model_len if self.schedulers else 0,
            "weight_bytes_per_rank": [i.weight_bytes for i in self.infos],
            "graph_mode": self.cfg.graph.mode, "buckets_captured": len(reports),
            "capture": self.cfg.graph.capture,
            "keys_total": cap.background.total if cap and cap.background else len(reports),
            "graphs_captured": sum(r.pieces for r in reports),
            "capture_s": round(cap.capture_s if cap else 0.0, 2),
            "graph_pool_bytes": sum(r.pool_bytes for r in reports),
            "graph_memory_bytes": [m.graph.held_bytes if m.graph else 0
                                   for m in (cap.memory if cap else [])],
        }

    def stats(self) -> dict:
        """Figures for clients and /metrics."""
        ss = self.schedulers
        kv = merge_stats([s.kv.stats() for s in ss])
        core = self.core or EngineCore([], None, False)
        reports = self.capture_report()
        return {
            "healthy": self.healthy, "reason": self.unhealthy_reason, "steps": self.steps,
            "restarts": self.restarts,
            "tokens_generated": self.tokens_generated, "preemptions": core.preemptions,
            "spec_decode_num_draft_tokens": sum(s.num_draft_tokens for s in ss),
            "spec_decode_num_accepted_tokens": sum(s.num_accepted_tokens for s in ss),
            "spec_decode_num_drafts": sum(s.num_drafts for s in ss),
            "spec_decode_num_accepted_tokens_per_pos": [sum(p) for p in zip(
                *(s.accepted_per_pos for s in ss))],
            "spec_decode_draft_s": round(self.draft_s, 6),
            "spec_decode_verify_s": round(self.verify_s, 6),
            # stalls (half the running sequences waiting on the step in flight: speculating
            # ones) waited out before scheduling, and not (engine/core.Turnaround), with the
            # host turnaround it measured
            "spec_loop_waits": core.turnaround.waits,
            "spec_loop_declined": core.turnaround.declined,
            "spec_loop_turnaround_ms": round(1e3 * core.turnaround.median_s(), 3),
            "worker_step_ms": round(1e3 * self.forward_s / max(1, self.steps), 3),
            # where a served step's time goes: the device idle between steps (rank 0), and
            # the step thread's own host time (its time in steps less waiting for replies)
            "device_idle_ms_per_step": round(1e3 * self.idle_s / max(1, self.steps), 3),
            "loop_host_ms_per_step": round(1e3 * (self.loop_s - self.wait_s)
                                           / max(1, self.steps), 3),
            "schedule_update_ms_per_step": round(1e3 * core.schedule_s / max(1, self.steps), 3),
            "requests_started": self.clients.first_tokens,
            "mean_ttft_ms": round(1e3 * self.clients.ttft_s / max(1, self.clients.first_tokens),
                                  3),
            "msg_bytes_per_step": round(core.msg_bytes / max(1, core.step_id)),
            "running": sum(len(s.running) for s in ss), "waiting": sum(len(s.waiting) for s in ss),
            "kv_utilization": kv["usage"],  # pinned pages of the fullest DP group
            "prefix_cache_hit_rate": round(kv["prefix_cache_hit_rate"], 4),
            "kv_cache": kv,  # the pools of every DP group (engine/kv_cache.merge_stats)
            "asleep": self.sleeper.asleep, "sleep_level": self.sleeper.level,
            "idle_asleep": self.sleeper.asleep and self.sleeper.idle,  # wakes on a request
            "idle_sleeps": self.sleeper.idle_sleeps, "last_wake_s": self.sleeper.last_wake_s,
            "kv_wake_error": self.sleeper.kv_error,  # a staged wake's mapping stopped short
            # counters for /metrics (cumulative; every HTTP replica reads the same)
            "prompt_tokens": self.clients.prompt_tokens,
            "generation_tokens": self.clients.generation_tokens,
            "finished": dict(self.clients.finished),
            "steps_by_phase": dict(core.phase_steps),
            # rank 0's steps and device seconds by its key's phase (cumulative)
            "device_steps_by_phase": dict(core.device_steps),
            "device_s_by_phase": {k: round(v, 6) for k, v in core.device_s.items()},
            "graphs_captured": sum(r.pieces for r in reports),
            "keys_captured": len(reports),
            "capture_s": self.capture.capture_s if self.capture else 0.0,
            "graph_pool_bytes": sum(r.pool_bytes for r in reports),
            "offload": self.cfg.offload.budget_bytes is not None,
            "lora": self.lora.registry.stats() if self.lora is not None else None,
        }

    async def worker_stats(self) -> list[dict]:
        """Per rank: memory (weights, KV, input buffers, graph pool) and, when weights are
        offloaded, the offload engine's copy figures."""
        mem, off = await self._on_step_thread(
            lambda: (self._call("memory_stats"), self._call("offload_stats")))
        return [{"memory": msgspec.to_builtins(m), "offload": msgspec.to_builtins(o)}
                for m, o in zip(mem, off)]

    # ---- capture (engine/capture.py) -------------------------------------------------------
    async def capture_schedule(self) -> list[KeyReport]:
        """Capture the whole schedule in lockstep, largest first; returns the per-key table.
        On any disagreement, failure or stall the worker group is torn down (a rank may be
        blocked in a collective) and CaptureError names the key and rank."""
        return await self._on_step_thread(self._capture_schedule)

    def _capture_schedule(self) -> list[KeyReport]:
        if self.capture is None:
            raise RuntimeError("no worker group to capture on")
        reports = self.capture.run_schedule()
        self._progress = msgspec.structs.replace(self._progress, capture=self.capture.progress)
        return reports

    def capture_report(self) -> list[KeyReport]:
        """The per-key capture table so far (also after a failed capture)."""
        return self.capture.report() if self.capture else []

    def capture_progress(self) -> dict:
        return self.capture.summary() if self.capture else {}

    def _capture_call(self, method: str, key: BucketKey) -> list[Any]:
        """One lockstep phase on every rank: over the compiled graph once it is up."""
        timeout = self.cfg.graph.capture_timeout_s
        if self.group is None or not self.group.compiled:
            return remote_call_all(self.workers, timeout)(method, key)
        try:
            return self.group.call(method, key, timeout=timeout)
        except Exception as e:
            raise CaptureError(f"{method} of {key} failed: {type(e).__name__}: "
                               f"{last_line(e)}") from None

    def _capture_failed(self, err: CaptureError, recover: bool) -> None:
        """recover: the step thread restarts the group (a background capture), so requests
        arriving during the teardown wait for it, not fail."""
        self.recovering = self.recovering or recover
        self.healthy = False
        self.unhealthy_reason = str(err)
        self._stop_workers()

    async def inject_fault(self, rank: int, kind: str, phase: str = "capture",
                           key: BucketKey | None = None) -> None:
        """Fault drills: arm `Worker.inject_fault` on one rank (through the step loop)."""
        def arm() -> None:
            if self.group is not None and self.group.compiled:
                self.group.call("inject_fault", kind, phase, key, only=rank,
                                timeout=self.cfg.step_timeout_s)
            else:
                ray.get(self.workers[rank].inject_fault.remote(kind, phase, key))
        await self._on_step_thread(arm)

    # ---- LoRA adapters (engine/lora.py) ---------------------------------------------------
    def _lora_admission(self) -> LoRAAdmission:
        from raygraph.lora import read_adapter  # torch: only where adapters are served

        lc = self.cfg.lora
        registry = LoRARegistry(
            lc.max_loras,
            lambda path: read_adapter(path, self.model_cfg, lc.max_lora_rank, lc.targets).rank,
            lc.max_adapters)
        for name, path in lc.modules:
            registry.register(name, path)
        return LoRAAdmission(registry)

    def _lora_registry(self) -> LoRARegistry:
        if self.lora is None:
            raise LoRAError("LoRA is off: start with --max-loras N (or --lora-modules)")
        return self.lora.registry

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """Register an adapter from a client (read and checked now; loaded into a slot on
        first use): only from under `LoRAConfig.allowed_dirs`; LoRAError if it cannot be
        served, which names no file and echoes nothing read from one."""
        registry = self._lora_registry()
        a = await asyncio.to_thread(registry.register_untrusted, name, path,
                                    self.cfg.lora.allowed_dirs)
        return {"name": a.name, "adapter_id": a.adapter_id, "rank": a.rank}

    async def unload_lora_adapter(self, name: str) -> None:
        """Forget an idle adapter; LoRAError while requests use it."""
        self._lora_registry().unregister(name)

    def list_lora_adapters(self) -> list[dict]:
        """The registered adapters: name, id, path, rank, slot (None: not hot), requests."""
        if self.lora is None:
            return []
        return [{"name": a.name, "adapter_id": a.adapter_id, "path": a.path, "rank": a.rank,
                 "slot": a.slot, "requests": a.requests} for a in self.lora.registry.adapters()]

    # ---- sleep and wake (engine/sleep.py) -----------------------------------------------
    async def sleep(self, level: int = 1, wait: bool = True) -> dict:
        """Stop admitting requests, let those in flight finish (wait=False: Busy if any),
        then every worker releases its memory: level 1 the graph pool and KV cache, level 2
        the weights too. Returns bytes released per rank and seconds."""
        if not self.healthy:
            raise WorkerFailure(f"the engine is not serving: {self.unhealthy_reason}")
        return await self.sleeper.sleep(level, wait)

    async def wake_up(self) -> dict:
        """Map the workers' memory back at the same addresses (no recapture) and serve."""
        return await self.sleeper.wake_up()

    def is_sleeping(self) -> bool:
        """Asleep by an operator's call (a replica asleep because idle serves on: its next
        request wakes it)."""
        return self.sleeper.asleep and not self.sleeper.idle

    async def _sleep_when_idle(self) -> None:
        """An elastic replica (past ReplicaConfig.awake) sleeps once no request came for
        idle_sleep_s and its background capture is done."""
        rc = self.cfg.replica
        while not self._stopping:
            await asyncio.sleep(min(1.0, rc.idle_sleep_s / 4))
            if self.clients.requests:
                self._active_at = time.monotonic()
            bg = self.capture.background if self.capture else None
            if (time.monotonic() - self._active_at >= rc.idle_sleep_s and self.healthy
                    and not self.recovering and self.sleeper.phase == "awake"
                    and (bg is None or bg.done)):
                log.info("replica %d idle for %.0fs: sleeping at level %d", self.replica,
                         rc.idle_sleep_s, rc.idle_sleep_level)
                await self.sleeper.sleep_idle(rc.idle_sleep_level)

    def sleep_level(self) -> int:
        """0 awake, else the level the workers sleep at."""
        return self.sleeper.level

    # ---- client API -------------------------------------------------------------------
    async def generate(self, prompts: Any, params: Any = None) -> list[GenerateResult]:
        """Generate for one prompt or a list (text or token ids); results in input order.

        Bad input raises BadRequest before anything is scheduled; other requests go on.
        """
        await self._wait_serving()
        await self._compile_grammars([params])
        reqs = self._submit(prompts, params)
        try:
            return list(await asyncio.gather(*(self.clients.result(r) for r in reqs)))
        finally:  # cancelled (`ray.cancel`: the client went away): stop computing the rest
            for r in reqs:
                if r.finish_reason is None:
                    self._abort(r.seq_id)

    async def generate_stream(self, prompt: Any, params: Any = None) -> AsyncIterator[StreamDelta]:
        """Yield each step's new tokens for one prompt; the last delta has finish_reason.

        Call as `coordinator.generate_stream.options(num_returns="streaming").remote(...)`.
        """
        await self._wait_serving()
        await self._compile_grammars([params])
        (req,) = self._submit(prompt, params, stream=True)
        try:
            while True:
                delta = take_deltas(req.deltas, await req.deltas.get())
                if req.error:  # it failed: this request has no more output
                    raise failure(req.error, req.bad_request)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if req.finish_reason is None:  # cancelled (the client went away): stop computing
                self._abort(req.seq_id)

    # ---- multiplexed streams: one delta channel per client process (an HTTP server) -----
    async def channel(self) -> ChannelAddress:
        """Where a process that streams requests from here reads their deltas
        (raygraph/channel.py): every delta of the streams it submits under its name, in
        batches. A delta with finish_reason "error" carries the error as its `error`.
        Closing the connection cancels its streams."""
        return await self.subscribers.address(ray.util.get_node_ip_address())

    def _unsubscribed(self, sink: asyncio.Queue) -> None:
        for req in [r for r in self.clients.requests.values() if r.deltas is sink]:
            self._abort(req.seq_id)

    async def submit_streams(self, name: str, requests: list[tuple[Any, Any]]
                             ) -> list[int | Exception]:
        """Start streamed requests, (prompt, params) each, whose deltas go to subscriber
        `name`: each one's request id, or the exception that refused it (BadRequest and the
        like: nothing of it was scheduled; the others start). One call for a burst: its
        prompts reach the step thread in step-sized groups (full prefill steps, not one per
        call as calls trickle in), and the burst pays one Ray call, not one each.

        Each group goes as soon as it is registered, a step's worth of prompt tokens for
        every DP group: the first step starts while the rest register (a 1,088-token
        prompt's ids take ~35 us to become a list on the CPU VM, 2-3x that on an H200's
        host: ~5 ms for a 64-prompt burst, which every first token used to wait for)."""
        await self._wait_serving()
        await self._compile_grammars([params for _, params in requests])
        # nothing is emitted before this returns: deltas come from this loop, which does not
        # yield below
        sink = self.subscribers.sink(name)
        # a step's worth for every DP group: each scheduler's first step fills
        step_tokens = self.cfg.scheduler.max_num_batched_tokens * len(self.schedulers)
        out: list[int | Exception] = []
        added: list[tuple[Sequence, str | None]] = []
        tokens = 0
        for prompt, params in requests:
            try:
                (req,), seqs = self._requests(prompt, params, stream=True)
            except Exception as e:  # this request's own error, for its caller
                out.append(e)
                continue
            req.deltas = sink
            out.append(req.seq_id)
            added += seqs
            tokens += sum(len(seq.prompt_token_ids) for seq, _ in seqs)
            if tokens >= step_tokens:
                self._enqueue(added)
                added, tokens = [], 0
        self._enqueue(added)
        return out

    def cancel(self, request_ids: list[int]) -> None:
        """Stop the given requests (their clients went away); finished ones are ignored. A
        subscribed stream gets a last "abort" delta, after which nothing comes for it."""
        for seq_id in request_ids:
            req = self.clients.requests.get(seq_id)
            if req is not None:
                self._abort(seq_id)
                req.deltas.put_nowait(StreamDelta(seq_id, [], None, "abort"))

    def _abort(self, seq_id: int) -> None:
        if self.clients.abort(seq_id):
            self._finish_on_stop_string(seq_id)  # frees it as a stop string would

    async def _wait_serving(self) -> None:
        """While the worker group restarts, new requests wait for it (as long as the model
        takes to load) instead of failing; if the restart fails, _submit reports why. A
        replica asleep because idle wakes first."""
        self._active_at = time.monotonic()
        while self.recovering:
            await asyncio.sleep(0.05)
        await self.sleeper.wake_for_request()

    def _submit(self, prompts: Any, params: Any, stream: bool = False) -> list[Request]:
        reqs, seqs = self._requests(prompts, params, stream)
        self._enqueue(seqs)
        return reqs

    def _requests(self, prompts: Any, params: Any, stream: bool
                  ) -> tuple[list[Request], list[tuple[Sequence, str | None]]]:
        """Checked and registered requests, and their sequences (with the adapter each
        names) for _enqueue; raises before registering any if one is bad."""
        if not self.healthy or not self.schedulers:
            reason = self.unhealthy_reason or "not started"
            raise WorkerFailure(f"the engine is not serving: {reason}")
        self.sleeper.check_admit()  # Asleep: refused, nothing queued, nothing restarted
        sp = parse_params(params).resolved(self.sampling_defaults)
        if sp.lora is not None and self.lora is None:
            raise UnknownAdapter(f"the model {sp.lora!r} does not exist (LoRA is off)")
        if sp.lora is not None:
            self.lora.registry.get(sp.lora)  # UnknownAdapter: nothing queued
        grammars = self.grammars.get() if sp.structured is not None else None
        if grammars is not None:
            grammars.compile(sp.structured)  # BadRequest: nothing queued
        items = [prompts] if stream else split_prompts(prompts)
        m = self.model_cfg
        encoded = [encode_prompt(p, self.tokenizer, m.vocab_size) for p in items]
        for ids in encoded:  # all checked before any is queued
            try:
                self.schedulers[0].check_prompt(len(ids))
            except ValueError as e:
                raise BadRequest(str(e)) from None
        reqs, seqs = [], []
        for ids in encoded:
            seq = Sequence(next(self._ids), ids, sp, watch=stream or bool(sp.stop))
            if grammars is not None:
                seq.guide = grammars.guide(sp.structured)
            seq.proposer = self.speculation(sp, ids)
            if sp.lora is not None:  # its blocks are keyed by the adapter's id
                seq.adapter_id = self.lora.registry.open(sp.lora).adapter_id
            reqs.append(self.clients.add(seq.seq_id, ids, sp, stream))
            seqs.append((seq, sp.lora))
        return reqs, seqs

    def speculation(self, sp: SamplingParams, prompt: list[int]) -> NgramIndex | ModelDrafts | None:
        """A new sequence's proposer when it speculates: speculation on, and a request
        without a grammar or logprobs (their tokens come one a step). Greedy ones keep the
        drafts the target's argmax agrees with, sampled ones go through rejection sampling
        (worker/speculative.py): either way their tokens are the target's own."""
        spec = self.cfg.speculative
        if not spec.method or sp.structured is not None or sp.logprobs is not None:
            return None
        if spec.method in ("draft", "eagle3"):
            return ModelDrafts()
        index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        index.extend(prompt)
        return index

    async def _compile_grammars(self, params: list[Any]) -> None:
        """The requests' grammars compiled on a thread (then cached) before they register,
        so a large schema holds up neither the event loop's other requests and streams nor
        the step thread. A bad one is left to fail its request when it registers."""
        specs = {spec for spec in map(structured_of, params) if spec is not None}
        if specs and self.tokenizer is not None:
            await asyncio.to_thread(self._warm_grammars, specs)

    def _warm_grammars(self, specs: set[StructuredOutputs]) -> None:
        grammars = self.grammars.get()
        for spec in specs:
            try:
                grammars.compile(spec)
            except BadRequest:
                pass  # cached: the request's registration reports it

    def _enqueue(self, seqs: list[tuple[Sequence, str | None]]) -> None:
        """To the step thread as one item: the prompts reach one step."""
        if seqs:
            self._inbox.put(("add", seqs))
            self._wake.set()

    def _finish_on_stop_string(self, seq_id: int) -> None:
        """From the event loop: a stop string ended this sequence; the step thread frees it."""
        self._inbox.put(("finish", seq_id))
        self._wake.set()

    # ---- the step loop (its own thread) -------------------------------------------------
    def _step_thread(self) -> None:
        while not self._stopping:
            self._wake.wait(timeout=KV_POLL_S if self.sleeper.kv_growing else 1.0)
            self._wake.clear()
            try:
                while self._drain_inbox() and not self._stopping:
                    if self.sleeper.poll_due():  # a staged wake: blocks mapped since
                        self._flush()
                        self.sleeper.poll_kv()
                    t0 = time.perf_counter()
                    busy = self._step()
                    self.loop_s += time.perf_counter() - t0
                    captured = self.healthy and self.capture is not None and \
                        self.capture.between_steps(busy, self._flush)
                    if captured:
                        self._progress = msgspec.structs.replace(
                            self._progress, capture=self.capture.progress)
                    elif not busy:
                        break
            except Exception as e:  # actor death, a raised step, a hang past the timeout
                self._on_failure(e)

    def _drain_inbox(self) -> bool:
        """New requests, stop-string finishes and calls from the event loop; False when the
        group is not serving (the step is skipped)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                serving = self.healthy and self.core is not None and not self.sleeper.asleep
                if serving and self.lora is not None and self.lora.waiting:
                    self.core.add(self.lora.admit([]))  # slots unpinned since: promote
                return serving
            kind = item[0]
            if kind == "add":
                if not self.healthy or self.core is None:
                    continue  # failed with the group; its request was told
                # items queued before a failure reach here after the restart: drop them
                live = [(seq, name) for seq, name in item[1]
                        if seq.seq_id >= self._stale_below]
                self.core.add([seq for seq, _ in live] if self.lora is None
                              else self.lora.admit(live))
            elif kind == "finish":
                seq = self.core.finish(item[1], "stop") if self.core else None
                if seq is not None and self.lora is not None:
                    self.lora.release(seq)
                elif self.lora is not None:
                    self.lora.drop(item[1])  # aborted while waiting for an adapter slot
            else:  # a call: nothing in flight while it runs
                fn, fut = item[1], item[2]
                try:
                    self._flush()
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)

    def _step(self) -> bool:
        """One step of the loop (EngineCore.step); False when there is no work."""
        emitted = self.core.step(self._dispatch)
        if emitted is None:
            return False
        self._deliver(emitted)
        if self.core.failed:  # failed adapters and grammars: their requests end with why
            failed, self.core.failed = self.core.failed, []
            for seq_id, msg, bad_request in failed:
                self.loop.call_soon_threadsafe(self.clients.fail, msg, [seq_id], bad_request)
        return True

    def _dispatch(self, msgs: list[bytes]) -> list[StepOutput]:
        t0 = time.perf_counter()
        outputs = self.group.step(msgs, timeout=self.cfg.step_timeout_s)
        self.wait_s += time.perf_counter() - t0
        out = outputs[0]
        if out.step_id >= 0:
            self.steps += 1
            self.forward_s += out.forward_s
            self.draft_s += out.draft_s
            if out.counts:  # a row verified drafts
                self.verify_s += out.forward_s
            if out.forward_s > 0.05:
                log.warning("step %d took %.1f ms on rank 0", out.step_id, 1e3 * out.forward_s)
            if out.step_id > self.core.resumed_at:  # not the first step after the loop idled
                self.idle_s += out.idle_s
                if out.idle_s > 0.01:
                    log.warning("the device waited %.1f ms before step %d", 1e3 * out.idle_s,
                                out.step_id)
        return outputs

    def _flush(self) -> None:
        if self.core is not None and self.core.in_flight is not None:
            self._deliver(self.core.flush(self._dispatch))

    def _deliver(self, emitted: list[list[tuple[Sequence, int]]]) -> None:
        """Hand tokens to the event loop: each one for watched requests (streams, stop
        strings); otherwise the first (TTFT) and, at the end, the whole output. So a batch
        of plain `generate` calls costs the event loop nothing per step."""
        items = []
        for pairs in emitted:
            self.tokens_generated += len(pairs)
            for i, (seq, token) in enumerate(pairs):
                # a verify step's tokens of one sequence come in a row: it finished, if it
                # did, with the last of them
                more = i + 1 < len(pairs) and pairs[i + 1][0] is seq
                reason = None if more else seq.finish_reason
                if reason == "error":
                    continue  # its grammar failed: the core's `failed` ends its request
                if seq.watch:
                    items.append((seq.seq_id, [token], reason, False, seq.logprobs[-1:],
                                  seq.scheduled_at))
                elif reason is not None:
                    items.append((seq.seq_id, list(seq.output_token_ids), reason, True,
                                  list(seq.logprobs), seq.scheduled_at))
                elif len(seq.output_token_ids) == 1:
                    items.append((seq.seq_id, [token], None, False, seq.logprobs[:1],
                                  seq.scheduled_at))
        if items:
            self.loop.call_soon_threadsafe(self.clients.emit, items)

    def _on_failure(self, e: BaseException) -> None:
        """Fail every request in flight, then restart the worker group (on the event loop;
        this thread waits for it)."""
        msg = f"step {self.core.step_id if self.core else 0} failed on a worker: " \
              f"{type(e).__name__}: {last_line(e)}"
        log.error(msg)
        self.recovering = True  # first: a request meeting `healthy` False then waits
        self.healthy = False
        self.unhealthy_reason = msg
        self.core = None
        self.loop.call_soon_threadsafe(self._fail_in_flight, msg)
        asyncio.run_coroutine_threadsafe(self._restart(msg), self.loop).result()

    def _fail_in_flight(self, msg: str) -> None:
        """On the event loop, in order with registrations: every request registered so far
        fails, and its sequences still in the inbox are dropped when the restarted group
        drains them (ids below the mark). The adapters' users reset here too, so a request
        registered later counts from zero. The step thread is waiting for the restart."""
        self.clients.fail(msg)
        if self.lora is not None:
            self.lora.reset()
        self._stale_below = next(self._ids)

    async def _restart(self, msg: str) -> None:
        self._stop_workers()
        try:
            await self._start_workers()
            self.healthy = True
            self.unhealthy_reason = None
            self.restarts += 1
            log.info("worker group restarted after failure")
        except Exception as restart_error:
            self.unhealthy_reason = f"{msg}; restart failed: {restart_error}"
            log.error(self.unhealthy_reason)
        finally:
            self.recovering = False

    def _stop_workers(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None
        self.workers = []
        self.core = None

    async def drain(self, timeout: float) -> int:
        """Wait, at most `timeout` seconds, until no request is in flight: the replica is
        leaving (new requests are still served). Returns how many are left."""
        deadline = time.monotonic() + timeout
        while self.clients.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.clients.requests)

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        self._stop_workers()
        self.subscribers.close()
        self.healthy = False
        self.unhealthy_reason = "shut down"
        self._stopped.set()

    def ping(self) -> bool:
        return True

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def wait_stopped(self) -> None:
        """Returns once `shutdown` ran: the coordinator's supervisor waits on it, and learns
        of the engine's death by this call failing."""
        await self._stopped.wait()

    def worker_handles(self) -> list[Any]:
        """The worker actors, for fault-injection tests and debugging."""
        return list(self.workers)


__all__ = ["Engine"]
