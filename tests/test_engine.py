"""EngineCore in the served loop's overlapped order: step N+1 is scheduled and sent before step
N's tokens are applied, and the workers' reply to step N carries step N-1's tokens.

A fake group of workers plays Worker.run: it decodes each StepDelta into its SeqTable, takes a
feed row's token from the previous step's sampled tokens (as the device does), checks every
write and read of a fake KV cache, samples the fake model token(seq_id, output index) and
replies with the previous step's tokens (b"": flush). So a sequence's tokens do not depend on
how it was batched, fed, chunked or preempted, and every token sampled on the "device" is seen,
including the ones the coordinator must discard.
"""

from __future__ import annotations

import random
from collections import defaultdict

import msgspec
import pytest

from raygraph.engine.core import EngineCore
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.protocol import NewSeq, SamplingParams, SeqStep, StepDelta, StepOutput
from raygraph.worker.state import SeqTable, StateError
from tests.test_scheduler import STOP_CASES, check_pool, kv_step, writable

EOS = 2
DELTA = msgspec.msgpack.Decoder(StepDelta)


def token(seq_id: int, index: int) -> int:
    return 100 + (seq_id * 7 + index * 3) % 50  # never EOS


def seq(seq_id: int, prompt_len: int, **params: object) -> Sequence:
    prompt = [10 + (seq_id + i) % 80 for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(**params))


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
         max_batched: int = 64, max_model_len: int = 256, caching: bool = False) -> Scheduler:
    return Scheduler(PagePool(num_blocks, block_size), max_num_seqs, max_batched,
                     max_model_len, eos_token_ids=(EOS,), prefix_caching=caching)


class FakeGroup:
    """One DP group's workers: SeqTable state, the fake model, a checked fake KV cache whose
    slots hold the tokens up to their position (the K/V computed from them), so a block
    shared through the prefix cache must hold the reader's own prefix."""

    def __init__(self, sched: Scheduler, forced: dict[int, dict[int, int]] | None = None):
        self.sched = sched
        self.forced = forced or {}
        self.seqs: dict[int, Sequence] = {}  # every seq ever added (for expected tokens)
        self.table = SeqTable()
        self.launched: StepOutput | None = None  # the step on the "device"
        self.prev: list[int] = []  # the last step's sampled tokens, kept on the "device"
        self.cache: dict[int, int] = {}  # slot -> prefix id of the tokens its K/V came from
        self.trie: dict[tuple[int, int], int] = {}  # (prefix id, next token) -> prefix id
        self.prefixes: dict[int, list[int]] = defaultdict(list)  # seq -> prefix id per pos
        self.sampled: dict[int, list[int]] = defaultdict(list)  # seq -> output indices sampled
        self.deltas: list[StepDelta] = []
        self.sizes: list[int] = []  # encoded bytes of each delta
        self.shapes: list[tuple[int, int]] = []  # (tokens, seqs) of each step's plan

    def add(self, q: Sequence) -> None:
        self.seqs[q.seq_id] = q
        self.sched.add(q)

    def model(self, seq_id: int, index: int) -> int:
        return self.forced.get(seq_id, {}).get(index, token(seq_id, index))

    def expected(self, seq_id: int, pos: int) -> int:
        prompt = self.seqs[seq_id].prompt_token_ids
        return prompt[pos] if pos < len(prompt) else self.model(seq_id, pos - len(prompt))

    def prefix(self, seq_id: int, pos: int) -> int:
        """An id of the expected tokens 0..pos: equal ids, equal token lists (a trie)."""
        ids = self.prefixes[seq_id]
        while len(ids) <= pos:
            key = (ids[-1] if ids else -1, self.expected(seq_id, len(ids)))
            ids.append(self.trie.setdefault(key, len(self.trie)))
        return ids[pos]

    def run(self, msg: bytes) -> StepOutput:
        """Worker.run: a step's reply carries the previous step's tokens; b"" is a flush."""
        reply, self.launched = self.launched, None
        if msg:
            self.launched = self.launch(DELTA.decode(msg), len(msg))
        return reply if reply is not None else StepOutput(-1, [])

    def launch(self, d: StepDelta, size: int) -> StepOutput:
        s, bs = self.sched, self.sched.pool.page_size
        self.deltas.append(d)
        self.sizes.append(size)
        plan = self.table.apply(d)
        self.shapes.append((plan.num_tokens, len(plan.seqs)))
        assert plan.num_tokens <= s.max_num_batched_tokens
        assert len(plan.seqs) <= s.max_num_seqs
        assert len({c.seq_id for c in plan.seqs}) == len(plan.seqs)
        tokens, counts, rows, writes, kept = [], [], [], [], []
        for c in plan.seqs:
            q = self.seqs[c.seq_id]
            assert c.block_table == q.block_table  # the workers' table is the scheduler's
            ids = c.token_ids
            if c.feed >= 0:  # the token this seq sampled last step, still on the device
                assert ids == [0] and c.sample
                assert self.prev[c.feed] is not None, "a feed after a verify step"
                ids = [self.prev[c.feed]]
            known = c.start_pos + len(ids) - c.verify  # positions before the drafts
            held = 0  # leading drafts that equal the model's tokens: kept
            while (held < c.verify
                   and ids[known - c.start_pos + held] == self.expected(c.seq_id, known + held)):
                held += 1
            own = {}
            for pos, t in enumerate(ids, c.start_pos):
                assert pos >= known or t == self.expected(c.seq_id, pos), (c, pos)
                block = c.block_table[pos // bs]
                assert writable(s, block, q, pos), "a write into a shared block"
                # a draft not kept leaves stale K/V: the chunk after the verify computes it anew
                stale = pos >= known + held
                own[block * bs + pos % bs] = -1 if stale else self.prefix(c.seq_id, pos)
            writes.append(own)
            kept.append(held)
        step_view = kv_step(self.cache, writes, plan.num_tokens == len(plan.seqs))
        for c, own, held in zip(plan.seqs, writes, kept, strict=True):
            q, view = self.seqs[c.seq_id], step_view(own)
            end = c.start_pos + len(c.token_ids) - c.verify + held  # to the last draft kept
            for pos in range(end):  # attention reads every earlier position through the table
                slot = c.block_table[pos // bs] * bs + pos % bs
                assert view(slot) == self.prefix(c.seq_id, pos), (c.seq_id, pos)
            if c.sample:
                # the sampled position follows the last one computed (and drafts kept)
                first = end - held - len(q.prompt_token_ids)
                # num_generated counts sampling steps: a verify that kept drafts is one
                assert c.num_generated == first or q.spec_drafts
                self.sampled[c.seq_id] += range(first, first + held + 1)
                tokens += [self.model(c.seq_id, i) for i in range(first, first + held + 1)]
                counts.append(held + 1)
                rows.append(None if c.verify else tokens[-1])
        self.prev = rows  # a verifying row's tokens vary in number: nothing to feed from
        verified = any(c.verify for c in plan.seqs)
        return StepOutput(d.step_id, tokens, counts=counts if verified else [])


class Groups:
    """EngineCore's dispatch: one FakeGroup per scheduler, pipelined replies."""

    def __init__(self, groups: list[FakeGroup]) -> None:
        self.groups = groups

    def __call__(self, msgs: list[bytes]) -> list[StepOutput]:
        assert len(msgs) == len(self.groups)
        return [g.run(m) for g, m in zip(self.groups, msgs, strict=True)]


def drive(core: EngineCore, groups: list[FakeGroup],
          arrivals: dict[int, list[tuple[int, Sequence]]] | None = None,
          aborts: dict[int, list[tuple[int, int]]] | None = None,
          max_steps: int = 5000) -> dict[int, list[int]]:
    """Run EngineCore.step until idle with nothing left to arrive; returns what was emitted per
    seq id, checking nothing is emitted for a seq after it finished."""
    arrivals, aborts = arrivals or {}, aborts or {}
    last = max([*arrivals, *aborts], default=-1)
    dispatch = Groups(groups)
    emitted: dict[int, list[int]] = defaultdict(list)
    for i in range(max_steps):
        for g, q in arrivals.get(i, []):
            groups[g].add(q)
        for g, seq_id in aborts.get(i, []):
            groups[g].sched.abort(seq_id)
        res = core.step(dispatch)
        if res is None:
            assert not any(g.sched.has_work() for g in groups), "work left, nothing scheduled"
            assert core.in_flight is None
            if i > last:
                break
            continue
        if core.in_flight is not None:  # the shape EngineCore buckets by is the plan's
            for g, out in zip(groups, core.in_flight, strict=True):
                if out is not None:
                    assert g.shapes[-1] == (out.num_tokens, out.num_seqs)
                    # decode rows: one token each, or a token and its drafts
                    assert out.decode == all(len(c.token_ids) == 1 + c.verify
                                             for _, c in out.chunks)
        for per_group in res:
            for q, t in per_group:
                assert q.finish_reason in (None, "stop", "length")
                emitted[q.seq_id].append(t)
            for q, _ in per_group:  # a verifying seq emits several tokens at once
                assert emitted[q.seq_id] == q.output_token_ids
        for g in groups:
            check_pool(g.sched)
    else:
        raise AssertionError("did not finish")
    for g in groups:
        s = g.sched
        assert not s.has_work() and s.pool.num_pinned == 0
        assert s.pool.num_free == s.pool.num_pages or s.kv.prefix_caching
    return emitted


def limit(s: Scheduler, q: Sequence) -> int:
    return min(q.params.max_tokens, s.max_model_len - len(q.prompt_token_ids))


def check_tokens(g: FakeGroup, emitted: dict[int, list[int]]) -> None:
    """Every seq emitted exactly the model's tokens: up to max_tokens / the context, or up to
    and including its stop token; the workers never sampled past what may be needed."""
    s = g.sched
    for q in g.seqs.values():
        n = limit(s, q)
        want = [g.model(q.seq_id, i) for i in range(n)]
        stops = [i for i, t in enumerate(want)
                 if t in q.params.stop_token_ids or (t == EOS and not q.params.ignore_eos)]
        if stops:
            want = want[: stops[0] + 1]
        got = emitted.get(q.seq_id, [])
        assert got == q.output_token_ids and q.block_table == [] and q.finish_reason
        indices = g.sampled[q.seq_id]
        assert len(indices) == len(set(indices)), "an output index was sampled twice"
        assert all(i < n for i in indices), "sampled past max_tokens / the context"
        if q.finish_reason == "abort":
            assert got == want[: len(got)]
            continue
        assert got == want, q.seq_id
        assert q.finish_reason == ("stop" if stops else "length")
        # at most the one token computed past a stop (sent before the stop was known)
        assert max(indices) <= len(want), (q.seq_id, indices)
        if not stops:
            assert max(indices) == n - 1 and q.num_pending == 0


def engine(*scheds: Scheduler) -> EngineCore:
    return EngineCore(list(scheds), None, ep=False)


def test_decode_is_fed_and_max_tokens_lands_exactly() -> None:
    s = make(block_size=4)
    g = FakeGroup(s)
    a = seq(0, 5, max_tokens=4)
    g.add(a)
    emitted = drive(engine(s), [g])
    assert emitted[0] == [token(0, i) for i in range(4)] and a.finish_reason == "length"
    d1, *rest = g.deltas
    assert [n.seq_id for n in d1.new] == [0] and d1.feed == []
    assert [(c.seq_id, c.token_ids, c.sample) for c in d1.chunks] == [
        (0, a.prompt_token_ids, True)]
    # every decode feeds the token sampled the step before; none after the 4th token
    assert [(d.feed, d.chunks) for d in rest] == [([0], [])] * 3
    assert g.sampled[0] == [0, 1, 2, 3]
    assert d1.blocks == [(0, 0), (0, 1)]  # positions 0-7: the 3 decodes need no more
    assert [(d.blocks, d.new, d.drop) for d in rest] == [([], [], [])] * 3


def test_stop_token_computed_one_past_is_discarded_and_dropped() -> None:
    s = make()
    g = FakeGroup(s, forced={0: {1: EOS}})
    a, b = seq(0, 3, max_tokens=10), seq(1, 3, max_tokens=8)
    g.add(a), g.add(b)
    emitted = drive(engine(s), [g])
    assert emitted[0] == [token(0, 0), EOS] and a.finish_reason == "stop"
    assert a.output_token_ids == [token(0, 0), EOS]
    assert g.sampled[0] == [0, 1, 2]  # index 2 was computed (past the stop) and discarded
    # the step after the stop became known drops it; it is never fed again
    dropped = [i for i, d in enumerate(g.deltas) if 0 in d.drop]
    assert len(dropped) == 1 and all(0 not in d.feed for d in g.deltas[dropped[0]:])
    assert 0 not in g.table.seqs
    assert emitted[1] == [token(1, i) for i in range(8)] and b.finish_reason == "length"


@pytest.mark.parametrize(("params", "forced", "reason", "n_out"),
                         STOP_CASES + [({"max_tokens": 1}, [], "length", 1)])
def test_stop_conditions_overlapped(params: dict, forced: list[int], reason: str,
                                    n_out: int) -> None:
    s = make(max_model_len=16)
    g = FakeGroup(s, forced={0: dict(enumerate(forced))})
    a = seq(0, 5, **params)
    g.add(a)
    emitted = drive(engine(s), [g])
    assert a.finish_reason == reason and len(a.output_token_ids) == n_out
    assert emitted[0] == a.output_token_ids
    assert len(a.prompt_token_ids) + len(a.output_token_ids) <= 16
    check_tokens(g, emitted)
    if reason == "length":  # known in advance: nothing computed past it
        assert g.sampled[0] == list(range(n_out))
    else:  # known one step late: exactly one token computed past the stop
        assert g.sampled[0] == list(range(n_out + 1))


def test_prompt_filling_the_context_but_one_emits_one_token() -> None:
    s = make(max_model_len=16)
    g = FakeGroup(s)
    g.add(seq(0, 15, max_tokens=5))
    emitted = drive(engine(s), [g])
    assert emitted[0] == [token(0, 0)] and g.sampled[0] == [0] and len(g.deltas) == 1


def test_preempted_with_a_token_in_flight_is_readmitted_with_its_tokens() -> None:
    s = make(num_blocks=3, block_size=4)
    g = FakeGroup(s)
    a, b = seq(0, 7, max_tokens=6), seq(1, 3, max_tokens=6)
    g.add(a), g.add(b)
    emitted = drive(engine(s), [g])
    check_tokens(g, emitted)
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    # step 3: a needs a 3rd block for position 8 while b's token of step 2 is in flight
    d3 = g.deltas[2]
    assert d3.drop == [1] and d3.feed == [0] and d3.blocks == [(0, 2)]
    # b comes back once a is done: tracked anew, with its whole token list sent explicitly
    (i,) = [i for i, d in enumerate(g.deltas) if d.new and d.new[0].seq_id == 1 and i > 0]
    d = g.deltas[i]
    assert [(n.seq_id, n.num_generated) for n in d.new] == [(1, 2)] and 0 in d.drop
    assert [(c.seq_id, c.token_ids, c.sample) for c in d.chunks] == [
        (1, b.prompt_token_ids + [token(1, 0), token(1, 1)], True)]
    assert g.sampled[1] == list(range(6))  # each output sampled once, none lost


def test_abort_with_a_token_in_flight() -> None:
    s = make()
    g = FakeGroup(s)
    a, b = seq(0, 3, max_tokens=20), seq(1, 3, max_tokens=10)
    g.add(a), g.add(b)
    core = engine(s)
    dispatch = Groups([g])
    emitted: dict[int, list[int]] = defaultdict(list)
    for _ in range(4):
        for q, t in core.step(dispatch)[0]:
            emitted[q.seq_id].append(t)
    assert a.num_pending == 1  # its token of step 4 is on the "device"
    assert s.abort(0) is a and a.finish_reason == "abort" and a.block_table == []
    emitted_a = list(a.output_token_ids)
    while (res := core.step(dispatch)) is not None:
        for q, t in res[0]:
            emitted[q.seq_id].append(t)
    assert emitted[0] == emitted_a == [token(0, i) for i in range(3)]  # nothing after abort
    assert a.output_token_ids == emitted_a
    assert sum(0 in d.drop for d in g.deltas) == 1 and 0 not in g.table.seqs
    assert emitted[1] == [token(1, i) for i in range(10)]
    assert s.pool.num_free == s.pool.num_pages and not s.has_work()


@pytest.mark.parametrize(
    ("num_blocks", "max_num_seqs", "max_batched", "seed", "groups"),
    [(10, 6, 16, 0, 1), (8, 4, 8, 1, 1), (12, 16, 5, 2, 1), (400, 8, 64, 3, 1),
     (16, 8, 12, 4, 1), (10, 6, 16, 5, 2), (400, 8, 64, 6, 2)])
@pytest.mark.parametrize("caching", [False, True])
def test_overlapped_simulation(num_blocks: int, max_num_seqs: int, max_batched: int,
                               seed: int, groups: int, caching: bool) -> None:
    """Random arrivals, lengths, stop tokens and aborts; tiny pools force preemption (with
    tokens in flight); two groups run idle steps while the other works. With caching,
    prompts share prefixes (a few system prompts) and recomputes hit their own blocks."""
    rng = random.Random(seed)
    max_len = min(40, num_blocks * 4)
    scheds = [make(num_blocks, 4, max_num_seqs, max_batched, max_len, caching)
              for _ in range(groups)]
    heads = [[rng.randrange(10, 90) for _ in range(rng.randint(0, 9))] for _ in range(3)]
    forced: dict[int, dict[int, int]] = {}
    arrivals: dict[int, list[tuple[int, Sequence]]] = defaultdict(list)
    aborts: dict[int, list[tuple[int, int]]] = defaultdict(list)
    where = {}
    for i in range(24 * groups):
        params: dict = {"max_tokens": rng.randint(1, 20)}
        r = rng.random()
        if r < 0.25:  # EOS at a random output index
            forced[i] = {rng.randrange(params["max_tokens"]): EOS}
        elif r < 0.35:
            params["stop_token_ids"] = [77]
            forced[i] = {rng.randrange(params["max_tokens"]): 77}
        elif r < 0.45:
            params["ignore_eos"] = True
            forced[i] = {rng.randrange(params["max_tokens"]): EOS}
        where[i] = rng.randrange(groups) if groups > 1 and i % 5 else 0
        q = seq(i, rng.randint(1, 15), **params)
        if caching:
            q.prompt_token_ids = (rng.choice(heads) + q.prompt_token_ids)[:15]
        arrivals[rng.randrange(30)].append((where[i], q))
    for i in rng.sample(range(24 * groups), 3):
        aborts[rng.randrange(40)].append((where[i], i))
    fakes = [FakeGroup(s, forced) for s in scheds]
    emitted = drive(engine(*scheds), fakes, arrivals, aborts)
    for g in fakes:
        check_tokens(g, emitted)
    all_seqs = [q for g in fakes for q in g.seqs.values()]
    assert len(all_seqs) == 24 * groups
    assert any(d.feed for g in fakes for d in g.deltas)  # the overlapped path was taken
    preempted = sum(q.num_preemptions for q in all_seqs)
    assert (preempted > 0) == (num_blocks < 100)  # tiny pools exercise recompute
    if groups > 1:  # a group with nothing to run still gets a (padding) step
        assert any(not d.feed and not d.chunks for g in fakes for d in g.deltas)
    assert (sum(s.kv.hits for s in scheds) > 0) == caching


def test_steady_decode_message_is_small_and_all_feed() -> None:
    n = 64
    s = make(num_blocks=64 * 16, block_size=16, max_num_seqs=n, max_batched=4096,
             max_model_len=512)
    g = FakeGroup(s)
    for i in range(n):
        g.add(seq(i, 5 + i % 37, max_tokens=200))
    core = engine(s)
    dispatch = Groups([g])
    for _ in range(4):  # prefill (one step: the 64 prompts fit the budget) and settle
        core.step(dispatch)
    start, sent = len(g.deltas), core.msg_bytes
    for _ in range(64):
        core.step(dispatch)
    steady = g.deltas[start:]
    assert len(steady) == 64
    for d in steady:
        assert d.feed == list(range(n)) and d.chunks == [] and d.new == [] and d.drop == []
    # a block now and then (block_size 16: each seq crosses 4 boundaries in 64 steps)
    assert sum(len(d.blocks) for d in steady) == 4 * n
    sizes = g.sizes[start:]
    assert sum(sizes) == core.msg_bytes - sent
    assert sum(sizes) / len(sizes) / n < 8, sizes
    # the prompt lengths differ, so the blocks come a few per step: no step is large (about
    # 2.3 bytes a seq here: one byte per id plus the field names)
    assert max(sizes) < 4 * n, sizes


def test_seq_table_feed_rows_count_sampling_rows_only() -> None:
    """A feed row indexes the previous step's sampled tokens: rows that sampled nothing (a
    prefill chunk) take no row."""
    t = SeqTable()
    t.apply(StepDelta(1, chunks=[SeqStep(0, [1, 2, 3], False), SeqStep(1, [4, 5], True),
                                 SeqStep(2, [6], True)],
                      new=[NewSeq(0), NewSeq(1), NewSeq(2, num_generated=3)],
                      blocks=[(0, 0), (1, 1), (2, 2)]))
    plan = t.apply(StepDelta(2, feed=[2, 1], chunks=[SeqStep(0, [7], True)]))
    assert [(c.seq_id, c.feed, c.token_ids, c.start_pos, c.num_generated, c.sample)
            for c in plan.seqs] == [(2, 1, [0], 1, 4, True), (1, 0, [0], 2, 1, True),
                                    (0, -1, [7], 3, 0, True)]
    plan = t.apply(StepDelta(3, feed=[0], drop=[1, 2]))
    assert [(c.seq_id, c.feed, c.start_pos, c.num_generated) for c in plan.seqs] == [
        (0, 2, 4, 1)]
    assert sorted(t.seqs) == [0]
    with pytest.raises(StateError):  # 2 was dropped
        t.apply(StepDelta(4, feed=[2]))
    t.apply(StepDelta(5, chunks=[SeqStep(0, [9], False)]))
    with pytest.raises(StateError):  # 0 sampled nothing in step 5
        t.apply(StepDelta(6, feed=[0]))


class Drafter:
    """A proposer (NgramIndex's interface) that drafts the fake model's next tokens, each
    wrong (token 1, which the model never gives) with probability `miss`."""

    asks = False  # proposes here, not on the workers

    def __init__(self, g: FakeGroup, q: Sequence, rng: random.Random, miss: float) -> None:
        self.g, self.q, self.rng, self.miss = g, q, rng, miss
        self.num_tokens = 0

    def extend(self, tokens: list[int]) -> None:
        self.num_tokens += len(tokens)

    def propose(self, k: int) -> list[int]:
        at = self.num_tokens - len(self.q.prompt_token_ids)
        return [1 if self.rng.random() < self.miss else self.g.model(self.q.seq_id, at + j)
                for j in range(k)]


@pytest.mark.parametrize(("max_batch", "seed"), [(0, 0), (3, 1), (3, 2), (5, 3)])
def test_speculation_overlapped(max_batch: int, seed: int) -> None:
    """Drafts, some wrong, verified in the overlapped order: every sequence emits the model's
    tokens, reads no stale K/V and never writes past its blocks. With speculative_max_batch,
    arrivals and finishes move the batch across it, so drafting turns off while verify steps
    are in flight: such a sequence is not fed (its step returns 1 to k + 1 tokens). A full
    batch (max_num_seqs running: no row for a draft) decodes as usual too, fed."""
    rng = random.Random(seed)
    s = Scheduler(PagePool(96, 4), 8, 32, 64, eos_token_ids=(EOS,), prefix_caching=False,
                  num_speculative_tokens=3, speculative_max_batch=max_batch)
    g = FakeGroup(s)
    arrivals: dict[int, list[tuple[int, Sequence]]] = defaultdict(list)
    for i in range(12):
        q = seq(i, rng.randint(1, 9), max_tokens=rng.randint(4, 30))
        q.proposer = Drafter(g, q, rng, miss=0.2)
        q.proposer.extend(q.prompt_token_ids)
        arrivals[rng.randrange(24)].append((0, q))
    emitted = drive(engine(s), [g], arrivals)
    check_tokens(g, emitted)
    assert s.num_draft_tokens > s.num_accepted_tokens > 0
    if max_batch:
        assert any(d.feed for d in g.deltas)  # drafts off: fed
