"""The step loop's logic, without transport or clients: schedule every DP group, turn the
result into one StepDelta per group, and apply the tokens that come back one step later.

The coordinator drives it over the compiled graph (engine/group.py); benchmarks and tests
drive it in one process against Worker.run. Pure Python apart from msgspec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from raygraph.config import ModelConfig, ServeConfig
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler, SchedulerOutput, Sequence
from raygraph.graph.buckets import IDLE_TOKENS, BucketPlan
from raygraph.protocol import BucketKey, StepDelta, StepOutput

ENCODER = msgspec.msgpack.Encoder()

# one step to the workers: a msgpack StepDelta per DP group (b"": flush) -> each group's
# tokens of the previous step
Dispatch = Callable[[list[bytes]], list[StepOutput]]


class EngineCore:
    def __init__(self, schedulers: list[Scheduler], buckets: BucketPlan | None,
                 ep: bool) -> None:
        self.schedulers = schedulers
        self.buckets = buckets
        self.ep = ep
        self.step_id = 0
        self.in_flight: list[SchedulerOutput | None] | None = None  # tokens not back yet
        self.msg_bytes = 0  # encoded deltas sent, summed over steps

    @staticmethod
    def from_config(cfg: ServeConfig, model: ModelConfig, num_blocks: int) -> EngineCore:
        """What a serving group runs with: a scheduler per DP group (each its own KV pool of
        `num_blocks`, with prefix caching as configured) and the config's bucket plan."""
        s, c = cfg.scheduler, cfg.cache
        max_len = cfg.max_model_len(model, num_blocks)
        schedulers = [Scheduler(PagePool.from_config(num_blocks, c), s.max_num_seqs,
                                s.max_num_batched_tokens, max_len, model.eos_token_ids,
                                c.enable_prefix_caching)
                      for _ in range(cfg.parallel.dp)]
        return EngineCore(schedulers, cfg.bucket_plan(), cfg.parallel.ep > 1)

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

    def apply(self, outputs: list[StepOutput]) -> list[list[tuple[Sequence, int]]]:
        """The tokens of the step in flight; returns each group's (seq, token) to emit."""
        outs, self.in_flight = self.in_flight, None
        if outs is None:
            return [[] for _ in self.schedulers]
        return [s.update(o, out.token_ids, out.logprobs) if o is not None else []
                for s, o, out in zip(self.schedulers, outs, outputs)]

    def step(self, dispatch: Dispatch) -> list[list[tuple[Sequence, int]]] | None:
        """Schedule, send, apply what comes back (the previous step's tokens). None: idle
        with nothing in flight. Used as is in one process; the coordinator interleaves
        lockstep captures between schedule and dispatch."""
        planned = self.schedule()
        if planned is None:
            return self.flush(dispatch) if self.in_flight is not None else None
        msgs = self.encode(*planned)
        emitted = self.apply(dispatch(msgs))
        self.in_flight = planned[0]
        return emitted

    def flush(self, dispatch: Dispatch) -> list[list[tuple[Sequence, int]]]:
        """Collect the step in flight."""
        return self.apply(dispatch([b""] * len(self.schedulers)))


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
