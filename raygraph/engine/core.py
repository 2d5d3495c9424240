"""The step loop's logic, without transport or clients: place new sequences on the least
loaded DP group, schedule every group, turn the result into one StepDelta per group, and
apply the tokens that come back one step later.

`EngineCore.step` is the one step there is: the engine's step thread calls it with a
dispatch over the compiled graph (engine/group.py), tests and benchmarks with one over a
Worker in this process. Two hooks plug into it: a capture policy that may rewrite the step's
keys (engine/capture.py: run a key not captured yet eagerly, or capture it first) and the
LoRA admission whose slot loads ride on the step. Where half the running sequences wait on
the step in flight (speculating ones), the step may collect it first (Turnaround says when
that pays). Pure Python apart from msgspec.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from raygraph.config import ModelConfig, ServeConfig
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler, SchedulerOutput
from raygraph.engine.sequence import Sequence
from raygraph.graph.buckets import IDLE_TOKENS, BucketPlan, bucket_plan
from raygraph.protocol import BucketKey, StepDelta, StepOutput

ENCODER = msgspec.msgpack.Encoder()

# one step to the workers: a msgpack StepDelta per DP group (b"": flush) -> each group's
# tokens of the previous step
Dispatch = Callable[[list[bytes]], list[StepOutput]]
Emitted = list[list[tuple[Sequence, int]]]  # per DP group: (sequence, token) to emit


class KeyPolicy(Protocol):
    """What the step does with keys not captured yet (engine/capture.Capture)."""

    def prepare(self, outs: list[SchedulerOutput | None], keys: list[BucketKey | None],
                flush: Callable[[], None]) -> None:
        """Rewrite `keys` in place (an eager key for one not captured), or capture a key
        first; `flush` collects the step in flight before anything is captured."""


class Turnaround:
    """Whether collecting the step in flight before scheduling pays (EngineCore._stalled).
    Waiting costs a host turnaround a step: the device idles from the end of the step in
    flight until the next arrives. Taking turns costs each sequence every other step. When
    a step reads its weights whatever its rows, a full step costs little more than a half
    one, and the wait pays while the turnaround is a small share of a step; on a small or
    fast model a turnaround through Ray is several steps long and the halves win. Measured
    on rank 0: its device time a step (on a CPU, host time: no overlap to lose there), and
    the device's idle before each step sent right after such a wait."""

    SHARE = 1 / 3  # wait while a turnaround costs at most this share of a step
    SAMPLES = 5  # turnarounds kept (their median is the estimate: a capture inflates one)
    FIRST = 3  # wait until this many are measured, so one outlier decides nothing
    PROBE = 256  # declined waits between two probes: a turnaround is measured only by waiting

    def __init__(self) -> None:
        self.step_s = 0.0  # device time a step, moving average from the first step's
        self.samples: deque[float] = deque(maxlen=self.SAMPLES)
        self.measured = 0  # turnarounds measured in all
        self.probe_step = -1  # the step sent right after a wait: its idle is a turnaround
        self.waits = self.declined = 0  # stalls waited out, and not

    def note(self, out: StepOutput) -> None:
        if out.step_id < 0:
            return
        if self.step_s:
            self.step_s += 0.25 * (out.forward_s - self.step_s)
        else:
            self.step_s = out.forward_s
        if out.step_id == self.probe_step:
            self.samples.append(out.idle_s)
            self.measured += 1

    def median_s(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0

    def pays(self) -> bool:
        if len(self.samples) < self.FIRST or self.median_s() <= self.SHARE * self.step_s:
            self.waits += 1
            return True
        self.declined += 1
        if self.declined % self.PROBE:
            return False
        self.waits += 1
        return True


class EngineCore:
    def __init__(self, schedulers: list[Scheduler], buckets: BucketPlan | None, ep: bool,
                 capture: KeyPolicy | None = None, lora: Any = None) -> None:
        """`lora`: engine/lora.LoRAAdmission, whose slot loads go with the step."""
        self.schedulers = schedulers
        self.buckets = buckets
        self.ep = ep
        self.capture = capture
        self.lora = lora
        self.step_id = 0
        self.in_flight: list[SchedulerOutput | None] | None = None  # tokens not back yet
        self.seqs: dict[int, tuple[int, Sequence]] = {}  # id -> (DP group, sequence)
        self.msg_bytes = 0  # encoded deltas sent, summed over steps
        self.schedule_s = 0.0  # in Scheduler.schedule and .update (all groups), summed
        self.preemptions = 0
        self.phase_steps: Counter[str] = Counter()  # steps per bucket phase, per DP group
        # rank 0's steps and device seconds per phase of its group's key (where time goes)
        self.device_steps: Counter[str] = Counter()
        self.device_s: Counter[str] = Counter()
        self._in_flight_phase = ""
        self.resumed_at = 0  # the first step after the loop last ran out of work
        # (seq id, error, the request's own doing): adapter loads that failed, grammars
        # that failed mid-answer
        self.failed: list[tuple[int, str, bool]] = []
        self._flushed: Emitted = []  # tokens collected by a flush inside the step
        self._capturing = False  # the capture policy captures before this step
        self.turnaround = Turnaround()

    @staticmethod
    def from_config(cfg: ServeConfig, model: ModelConfig, num_blocks: int,
                    capture: KeyPolicy | None = None, lora: Any = None) -> EngineCore:
        """What a serving group runs with: a scheduler per DP group (each its own KV pool of
        `num_blocks`, with prefix caching as configured) and the config's bucket plan."""
        s, c = cfg.scheduler, cfg.cache
        max_len = cfg.max_model_len(model, num_blocks)
        schedulers = [Scheduler(PagePool.from_config(num_blocks, c), s.max_num_seqs,
                                s.max_num_batched_tokens, max_len, model.eos_token_ids,
                                c.enable_prefix_caching,
                                cfg.speculative.num_speculative_tokens if cfg.speculative.method
                                else 0, cfg.speculative.disable_by_batch_size)
                      for _ in range(cfg.parallel.dp)]
        return EngineCore(schedulers, bucket_plan(cfg), cfg.parallel.ep > 1, capture, lora)

    # ---- sequences ---------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        """New sequences, each to the DP group with the fewest sequences."""
        for seq in seqs:
            group = min(range(len(self.schedulers)), key=self._load)
            self.schedulers[group].add(seq)
            self.seqs[seq.seq_id] = (group, seq)

    def _load(self, group: int) -> int:
        s = self.schedulers[group]
        return len(s.running) + len(s.waiting)

    def finish(self, seq_id: int, reason: str) -> Sequence | None:
        """End a sequence early (a stop string, an abort, a failed adapter); its blocks are
        freed. None if it had finished already."""
        entry = self.seqs.pop(seq_id, None)
        if entry is None:
            return None
        self.schedulers[entry[0]].finish(entry[1], reason)
        return entry[1]

    def schedule(self) -> tuple[list[SchedulerOutput | None], list[BucketKey | None],
                                int] | None:
        """The next step of every group (None: nothing to run), its keys and dispatch size."""
        outs = [s.schedule() for s in self.schedulers]
        if all(o is None for o in outs):
            return None
        # an idle group runs one padding token, so the MoE collectives still match
        idle = (IDLE_TOKENS, IDLE_TOKENS, True)
        shapes = [(o.num_tokens, o.num_seqs, o.decode) if o else idle for o in outs]
        if self.buckets is None:  # eager mode: the dispatch size is the largest real batch
            comm = max(t for t, _, _ in shapes) if self.ep else 0
            keys: list[BucketKey | None] = [None] * len(outs)
        else:
            comm = self.buckets.comm_tokens(shapes) if self.ep else 0
            keys = [self.buckets.key(t, n, d, comm) for t, n, d in shapes]
        return outs, keys, comm

    def encode(self, outs: list[SchedulerOutput | None], keys: list[BucketKey | None],
               comm: int, lora_loads: list[tuple[int, str]] | None = None) -> list[bytes]:
        """One message per group; also takes the step id. `lora_loads` (slot, path) go to
        every group: every rank loads them before the step."""
        self.step_id += 1
        loads = lora_loads or []
        msgs = [ENCODER.encode(StepDelta(
            self.step_id, [s.seq_id for s in o.feed], [c for _, c in o.chunks], o.new,
            o.blocks, o.drop, k, comm, loads) if o is not None else
            StepDelta(self.step_id, key=k, num_comm_tokens=comm, lora_loads=loads))
            for o, k in zip(outs, keys)]
        self.msg_bytes += sum(len(m) for m in msgs)
        return msgs

    def apply(self, outputs: list[StepOutput]) -> Emitted:
        """The tokens of the step in flight; returns each group's (seq, token) to emit."""
        outs, self.in_flight = self.in_flight, None
        if outs is None:
            return [[] for _ in self.schedulers]
        self.turnaround.note(outputs[0])
        if outputs[0].step_id >= 0:
            self.device_steps[self._in_flight_phase] += 1
            self.device_s[self._in_flight_phase] += outputs[0].forward_s
        return [s.update(o, out.token_ids, out.logprobs, out.counts, out.drafts)
                if o is not None else []
                for s, o, out in zip(self.schedulers, outs, outputs)]

    def step(self, dispatch: Dispatch) -> Emitted | None:
        """Schedule and send one step, apply the one before; returns the tokens to emit
        (those of a flush first, for stalled sequences or the capture policy, included).
        None: idle with nothing in flight."""
        self._flushed = []
        waited = self.in_flight is not None and self._stalled()
        if waited:
            self._flushed = self.flush(dispatch)
        t0 = time.perf_counter()
        planned = self.schedule()
        self.schedule_s += time.perf_counter() - t0
        if planned is None:
            if self._flushed:
                return self._flushed
            if self.in_flight is None:
                self.resumed_at = self.step_id + 1  # its device gap is the clients' pause
                return None
            return self.flush(dispatch)
        outs, keys, comm = planned
        self._capturing = False
        if self.capture is not None:  # new shapes: captured on every rank, nothing in flight
            self.capture.prepare(outs, keys, lambda: self._flush_into(dispatch))
        for o in outs:
            if o is not None:
                self.preemptions += len(o.preempted)
        for key in keys:  # per DP group: a replay of its bucket's graph, or an eager step
            self.phase_steps[key.phase if key is not None else "eager"] += 1
        loads = self.lora.take_loads() if self.lora is not None else []
        outputs = dispatch(self.encode(outs, keys, comm, loads))
        if waited and not self._capturing:  # a capture's time is no turnaround
            self.turnaround.probe_step = self.step_id
        t0 = time.perf_counter()
        emitted = self.apply(outputs)
        self.schedule_s += time.perf_counter() - t0
        self.in_flight = outs
        self._in_flight_phase = keys[0].phase if keys[0] is not None else "eager"
        if loads:
            self._loaded(outputs)
        self._forget_finished(emitted)
        if self._flushed:  # walked by flush already
            emitted = [a + b for a, b in zip(self._flushed, emitted)]
        return emitted

    def _stalled(self) -> bool:
        """Whether to collect the step in flight before scheduling: at least half the running
        sequences wait on it (speculating ones: a verify step's tokens come back a step
        later), and a host turnaround is cheap against a step (Turnaround). Then they all
        join the next step; else the others run alone, and the batch splits into two
        halves that take turns."""
        awaiting = sum(s.num_awaiting() for s in self.schedulers)
        return (awaiting > 0 and 2 * awaiting >= sum(len(s.running) for s in self.schedulers)
                and self.turnaround.pays())

    def _flush_into(self, dispatch: Dispatch) -> None:
        self._capturing = True
        if self.in_flight is not None:
            self._flushed = self.flush(dispatch)

    def _loaded(self, outputs: list[StepOutput]) -> None:
        """After a step that loaded adapter slots: the sequences whose adapter failed to
        load end (the step in flight computed them with a zero slot: their tokens are
        dropped); `failed` tells the engine to fail their requests."""
        for seq_id, msg in self.lora.loaded([r for out in outputs for r in out.lora_loads]):
            self.finish(seq_id, "error")
            self.failed.append((seq_id, msg, False))

    def _forget_finished(self, emitted: Emitted) -> None:
        for pairs in emitted:
            for seq, _ in pairs:
                if seq.finish_reason is not None and self.seqs.pop(seq.seq_id, None):
                    if self.lora is not None:
                        self.lora.release(seq)
                    if seq.finish_reason == "error" and seq.guide is not None:
                        self.failed.append((seq.seq_id, seq.guide.error or "grammar failed",
                                            True))

    def flush(self, dispatch: Dispatch) -> Emitted:
        """Collect the step in flight."""
        emitted = self.apply(dispatch([b""] * len(self.schedulers)))
        self._forget_finished(emitted)
        return emitted


def local_dispatch(worker: Any) -> Dispatch:
    """Steps to a Worker in this process (one DP group of one rank): tests, benchmarks."""
    decoder = msgspec.msgpack.Decoder(StepOutput)

    def dispatch(msgs: list[bytes]) -> list[StepOutput]:
        (msg,) = msgs
        return [decoder.decode(worker.run(msg))]

    return dispatch


def run_to_completion(core: EngineCore, dispatch: Dispatch) -> int:
    """Step until every scheduler is empty and nothing is in flight; returns the steps."""
    steps = 0
    while core.step(dispatch) is not None:
        steps += 1
    return steps
