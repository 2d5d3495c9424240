"""Continuous batching with chunked prefill and preemption by recompute. Pure Python.

Every step spends a token budget: running sequences first (decode = 1 token, or the next
chunk of a long prompt), then waiting ones in arrival order. When blocks run out the most
recently admitted running sequence is preempted: its blocks are freed and it goes back to
the front of the queue to recompute prompt + output so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from raygraph.memory.pages import BlockPool
from raygraph.protocol import FinishReason, SamplingParams, SeqChunk, StepPlan


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """token_ids[start:start + n] without building the whole list (hot path: decode)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        head = self.prompt_token_ids[start : start + n]
        return head + self.output_token_ids[: max(0, start + n - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SchedulerOutput:
    plan: StepPlan
    seqs: list[Sequence]  # in plan order
    preempted: list[Sequence]


class Scheduler:
    def __init__(
        self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
        max_model_len: int, eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._step = 0

    def check_prompt(self, num_tokens: int) -> None:
        """Refuse a prompt that leaves no room for one generated token."""
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_tokens} tokens; the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )

    def add(self, seq: Sequence) -> None:
        self.check_prompt(seq.num_tokens)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_id: int) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._release(seq, "abort")
                    return seq
        return None

    def schedule(self) -> SchedulerOutput | None:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, n, preempted):
                break  # seq itself was preempted (it was the last one running)
            chosen.append((seq, n))
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            seq.block_table += self.pool.allocate(need)
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
        if not chosen:
            return None
        self._step += 1
        chunks = [self._chunk(seq, n) for seq, n in chosen]
        return SchedulerOutput(StepPlan(self._step, chunks), [s for s, _ in chosen], preempted)

    def _reserve(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Make room for n more tokens of seq, preempting from the back of the running list."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        while need > self.pool.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    @staticmethod
    def _chunk(seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_computed
        p = seq.params
        return SeqChunk(
            seq_id=seq.seq_id, token_ids=seq.token_slice(start, n), start_pos=start,
            block_table=list(seq.block_table), sample=start + n == seq.num_tokens,
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
            num_generated=len(seq.output_token_ids),
        )

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[Sequence, int]]:
        """Apply one step's results; returns (seq, new token) pairs. Finished sequences leave."""
        tokens = iter(sampled)
        new: list[tuple[Sequence, int]] = []
        for seq, chunk in zip(out.seqs, out.plan.seqs):
            seq.num_computed += len(chunk.token_ids)
            if not chunk.sample:
                continue
            token = next(tokens)
            seq.output_token_ids.append(token)
            new.append((seq, token))
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
        return new

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.finish_reason is not None:
            return
        self.running.remove(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.finish_reason = reason
