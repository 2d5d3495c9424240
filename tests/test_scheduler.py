"""Scheduler + PagePool: chunked prefill, budgets, blocks, preemption, stop conditions (prefix
caching: tests/test_prefix_cache.py; off here unless a test says so, so pools empty exactly).

A fake "model" returns token(seq_id, output index), so a sequence's outputs do not depend on
how it was batched or preempted, and a fake KV cache checks what each step may read.

Each step goes through the workers' side too: the SchedulerOutput becomes a StepDelta (msgpack
round trip) that a SeqTable turns into the StepPlan the executor would run, so the checks read
positions, tokens and block tables as the workers see them. Tokens are applied right after each
step (the overlapped order of the served loop is tested in test_engine.py).
"""

from __future__ import annotations

import random
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest

from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler, SchedulerOutput
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams, SeqChunk, StepDelta, StepPlan
from raygraph.worker.state import SeqTable

EOS = 2
TABLES: weakref.WeakKeyDictionary[Scheduler, SeqTable] = weakref.WeakKeyDictionary()


def token(seq_id: int, index: int) -> int:
    return 100 + (seq_id * 7 + index * 3) % 50  # never EOS


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
         max_batched: int = 64, max_model_len: int = 256, caching: bool = False) -> Scheduler:
    s = Scheduler(PagePool(num_blocks, block_size), max_num_seqs, max_batched,
                  max_model_len, eos_token_ids=(EOS,), prefix_caching=caching)
    TABLES[s] = SeqTable()  # the workers' state for this scheduler
    return s


def seq(seq_id: int, prompt_len: int, **params: object) -> Sequence:
    prompt = [10 + (seq_id + i) % 80 for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(**params))


def delta(out: SchedulerOutput, step_id: int = 0) -> StepDelta:
    """The step as the workers receive it (through msgpack, as EngineCore.encode sends it)."""
    d = StepDelta(step_id, [q.seq_id for q in out.feed], [c for _, c in out.chunks], out.new,
                  out.blocks, out.drop)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=StepDelta)


@dataclass
class Step:
    out: SchedulerOutput
    delta: StepDelta
    seqs: list[SeqChunk]  # the plan's chunks; feed rows carry their real token

    @property
    def preempted(self) -> list[Sequence]:
        return self.out.preempted


def plan(s: Scheduler, out: SchedulerOutput) -> tuple[StepDelta, StepPlan, list[SeqChunk]]:
    """Apply the step to the scheduler's SeqTable; feed rows (token_ids [0], the token still on
    the device) get the seq's last known output, which is the token they decode here."""
    d = delta(out)
    p = TABLES[s].apply(d)
    by_id = {q.seq_id: q for q in out.feed}
    chunks = []
    for c in p.seqs:
        if c.feed >= 0:
            assert c.token_ids == [0]
            c = msgspec.structs.replace(c, token_ids=[by_id[c.seq_id].output_token_ids[-1]])
        # copy: the table's block lists keep growing after this step
        chunks.append(msgspec.structs.replace(c, block_table=list(c.block_table)))
    return d, p, chunks


def step(s: Scheduler, tokens: dict[int, list[int]] | None = None) -> Step:
    """One step with the fake model; `tokens` overrides outputs per seq_id by index."""
    out = s.schedule()
    assert out is not None
    d, p, chunks = plan(s, out)
    # the plan's batch order is the order update() expects its tokens in
    assert [c.seq_id for c in chunks if c.sample] == [q.seq_id for q in out.sampled]
    forced = {k: dict(enumerate(v)) for k, v in (tokens or {}).items()}
    sampled = []
    for q in out.sampled:
        i = len(q.output_token_ids)  # the output index of its pending token
        sampled.append(forced.get(q.seq_id, {}).get(i, token(q.seq_id, i)))
    s.update(out, sampled)
    return Step(out, d, chunks)


def test_chunked_prefill_respects_budget() -> None:
    s = make(max_batched=8, block_size=4)
    a = seq(0, 20)
    s.add(a)
    expect = [(0, 8, False, 2), (8, 8, False, 4), (16, 4, True, 5)]
    tables = []
    for start, n, sample, nblocks in expect:
        st = step(s)
        (c,) = st.seqs
        assert (c.start_pos, len(c.token_ids), c.sample, len(c.block_table)) == (
            start, n, sample, nblocks)
        assert c.token_ids == a.prompt_token_ids[start : start + n]
        assert st.out.num_tokens == n and not st.out.feed
        tables.append(c.block_table)
    assert a.output_token_ids == [token(0, 0)] and a.num_pending == 0
    (c,) = step(s).seqs  # decode: position 20 crosses into a 6th block
    assert (c.start_pos, c.token_ids, c.sample, c.num_generated) == (20, [token(0, 0)], True, 1)
    tables.append(c.block_table)
    for short, long in zip(tables, tables[1:], strict=False):
        assert long[: len(short)] == short  # tables only grow at the end
    assert len(tables[-1]) == 6 and len(set(tables[-1])) == 6
    assert tables[-1] == a.block_table  # the workers' table is the scheduler's
    assert s.pool.num_free == 64 - 6


def test_delta_sends_each_block_and_new_seq_once() -> None:
    s = make(max_batched=8, block_size=4)
    a = seq(0, 10)
    s.add(a)
    d = step(s).delta
    assert [n.seq_id for n in d.new] == [0] and d.new[0].num_generated == 0
    assert d.blocks == [(0, b) for b in a.block_table] and len(d.blocks) == 2
    d = step(s).delta  # the rest of the prompt: a third block, no new entry
    assert d.new == [] and d.blocks == [(0, a.block_table[2])] and d.drop == []
    d = step(s).delta  # decode at position 10: the third block has room
    assert d.new == d.blocks == d.drop == [] and not d.feed
    assert [(c.seq_id, c.sample) for c in d.chunks] == [(0, True)]


def test_running_first_then_waiting_gets_the_rest_of_the_budget() -> None:
    """Running sequences come first, so a mixed step's decode rows lead its batch (the rows
    ops.decode_rows gives the decode kernel); waiting prompts take what budget is left."""
    s = make(max_batched=8)
    s.add(seq(0, 3)), s.add(seq(1, 4))
    step(s)
    s.add(seq(2, 30))
    st = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids), c.sample) for c in st.seqs] == [
        (0, 3, 1, True), (1, 4, 1, True), (2, 0, 6, False)]
    assert st.out.num_tokens == 8
    s.add(seq(3, 2))  # budget fully spent by running seqs: 3 waits
    st = step(s)
    assert [(c.seq_id, len(c.token_ids)) for c in st.seqs] == [(0, 1), (1, 1), (2, 6)]
    assert [q.seq_id for q in s.waiting] == [3]


def test_max_num_seqs_caps_admission() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(seq(i, 3, max_tokens=2 if i == 0 else 5))
    assert [c.seq_id for c in step(s).seqs] == [0, 1]
    assert [c.seq_id for c in step(s).seqs] == [0, 1]  # 0 finishes (2 tokens)
    assert [q.seq_id for q in s.running] == [1] and [q.seq_id for q in s.waiting] == [2, 3]
    st = step(s)
    assert [c.seq_id for c in st.seqs] == [1, 2] and st.delta.drop == [0]  # 0 forgotten
    assert len(s.running) == 2 and [q.seq_id for q in s.waiting] == [3]


def test_preempts_most_recent_and_recomputes() -> None:
    s = make(num_blocks=4, block_size=4, max_num_seqs=3)
    a, b, c, d = (seq(i, 4, max_tokens=3) for i in range(4))
    for q in (a, b, c, d):
        s.add(q)
    st = step(s)  # d waits: max_num_seqs
    assert [len(ch.block_table) for ch in st.seqs] == [1, 1, 1] and s.pool.num_free == 1
    st = step(s)  # a takes the last free block; b needs one too: c (newest) is preempted
    assert [ch.seq_id for ch in st.seqs] == [0, 1] and st.preempted == [c]
    assert st.delta.drop == [2]  # the workers forget c
    assert c.block_table == [] and c.num_computed == 0 and c.num_preemptions == 1
    assert list(s.waiting) == [c, d] and s.running == [a, b] and s.pool.num_free == 0
    assert c.output_token_ids == [token(2, 0)]
    step(s)  # a and b finish (3 tokens); c waits until then
    assert a.finish_reason == b.finish_reason == "length" and s.pool.num_free == 4
    st = step(s)
    ch, dh = st.seqs  # c first: it went back to the front of the queue
    assert sorted(st.delta.drop) == [0, 1]
    assert [(n.seq_id, n.num_generated) for n in st.delta.new] == [(2, 1), (3, 0)]
    assert (ch.seq_id, ch.start_pos, ch.sample, ch.num_generated) == (2, 0, True, 1)
    assert ch.token_ids == c.prompt_token_ids + [token(2, 0)] and len(ch.block_table) == 2
    assert (dh.seq_id, dh.start_pos, dh.num_generated) == (3, 0, 0)
    while s.has_work():
        step(s)
    assert c.output_token_ids == [token(2, i) for i in range(3)]
    assert c.finish_reason == "length" and s.pool.num_free == 4


def test_preemption_victim_is_newest_even_if_the_newest_needs_nothing() -> None:
    s = make(num_blocks=3, block_size=4)
    a, b = seq(0, 7, max_tokens=6), seq(1, 3, max_tokens=6)
    s.add(a), s.add(b)
    step(s)  # a: 2 blocks, b: 1 block
    step(s)  # a at 8 tokens, b at 4: no new blocks yet
    st = step(s)  # a needs a 3rd block: b is popped and freed, a takes one of its blocks
    assert [ch.seq_id for ch in st.seqs] == [0] and st.preempted == [b]
    assert b.num_computed == 0 and list(s.waiting) == [b] and len(a.block_table) == 3
    assert st.delta.drop == [1] and st.delta.blocks == [(0, a.block_table[2])]


def test_newest_seq_preempts_itself() -> None:
    s = make(num_blocks=3, block_size=4)
    a, b = seq(0, 2, max_tokens=6), seq(1, 8, max_tokens=6)
    s.add(a), s.add(b)
    step(s)  # a: 1 block, b: 2 blocks, pool empty
    st = step(s)  # b needs a 3rd block for position 8: nothing older may be taken
    assert [ch.seq_id for ch in st.seqs] == [0] and st.preempted == [b]
    assert s.running == [a] and s.pool.num_free == 2 and b.output_token_ids == [token(1, 0)]
    assert st.delta.drop == [1]


def test_no_admission_in_a_step_that_preempts() -> None:
    s = make(num_blocks=4, block_size=4, max_batched=4)
    a, b = seq(0, 4, max_tokens=10), seq(1, 12, max_tokens=2)
    s.add(a)
    step(s)
    s.add(b)
    step(s), step(s)  # b prefills 3 tokens a step next to a's decodes: the pool is full
    st = step(s)  # b needs a 3rd block and preempts itself: 2 blocks free, enough for its
    # next chunk, but it is not readmitted in the step that dropped it
    assert [c.seq_id for c in st.seqs] == [0] and st.preempted == [b]
    assert st.delta.drop == [1] and st.delta.new == [] and s.pool.num_free == 2
    st = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in st.seqs] == [(0, 7, 1),
                                                                            (1, 0, 3)]
    assert [n.seq_id for n in st.delta.new] == [1]


# (params, forced outputs, finish reason, outputs emitted); the prompt has 5 tokens, the
# context 16. Shared with tests/test_engine.py, which runs them overlapped.
STOP_CASES = [
    ({"max_tokens": 10}, [5, EOS, 6], "stop", 2),
    ({"max_tokens": 4, "ignore_eos": True}, [5, EOS, 6], "length", 4),
    ({"max_tokens": 10, "stop_token_ids": [77]}, [5, 6, 77, 8], "stop", 3),
    ({"max_tokens": 10, "ignore_eos": True, "stop_token_ids": [77]}, [EOS, 77], "stop", 2),
    ({"max_tokens": 3}, [], "length", 3),
    ({"max_tokens": 100}, [], "length", 16 - 5),  # max_model_len
]


@pytest.mark.parametrize(("params", "forced", "reason", "n_out"), STOP_CASES)
def test_stop_conditions(params: dict, forced: list[int], reason: str, n_out: int) -> None:
    s = make(max_model_len=16)
    a = seq(0, 5, **params)
    s.add(a)
    while s.has_work():
        step(s, {0: forced})
    assert a.finish_reason == reason and len(a.output_token_ids) == n_out
    assert a.output_token_ids == [forced[i] if i < len(forced) else token(0, i)
                                  for i in range(n_out)]
    assert a.num_tokens <= 16 and a.num_pending == 0 and s.pool.num_free == 64


def test_prompt_must_leave_room_for_one_token() -> None:
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match="16"):
        s.add(seq(0, 16))
    s.add(seq(1, 15))
    step(s)
    assert s.running == [] and s.pool.num_free == 64  # finished by max_model_len


def test_abort_frees_blocks() -> None:
    s = make(num_blocks=16, max_batched=4)
    a, b = seq(0, 10), seq(1, 3)
    s.add(a)
    step(s)
    s.add(b)
    assert s.abort(1) is b and b.finish_reason == "abort"
    assert s.pool.num_free == 15
    assert s.abort(0) is a and a.block_table == [] and s.pool.num_free == 16
    assert s.abort(0) is None and not s.has_work()
    assert s.schedule() is None  # nothing to run: the drop waits for the next step
    s.add(seq(2, 3))
    assert step(s).delta.drop == [0]  # a was tracked by the workers; b never was
    assert 0 not in TABLES[s].seqs


def check_pool(s: Scheduler) -> None:
    """Each running seq's blocks are distinct and pinned once per seq holding them (shared
    cached blocks: by several); waiting seqs hold none."""
    held = Counter(b for q in s.running for b in q.block_table)
    assert all(len(set(q.block_table)) == len(q.block_table) for q in s.running)
    assert all(q.block_table == [] for q in s.waiting)
    assert {b: s.pool.page_info(b).refs for b in held} == held
    assert sum(held.values()) == sum(s.pool.page_info(b).refs for b in held)
    assert len(held) == s.pool.num_pinned
    s.pool.check_invariants()


def writable(s: Scheduler, block: int, q: Sequence, pos: int) -> bool:
    """q may write position pos into block: a block of its own, or one it fills for the first
    time (past its cached tokens, allocated to it) that others joined in the same step."""
    info = s.pool.page_info(block)
    return info.refs == 1 or (info.owner == q.seq_id and pos >= q.num_cached_tokens)


def kv_step(cache: dict, writes: list[dict], decode: bool) -> Callable:
    """A step's K/V as the kernels order it; returns own writes -> (slot -> what a row
    reads). Any other step stores every row's K/V, then attends (ops.paged_attention); the
    decode kernel's rows store and attend in parallel, so a row sees this step's writes of
    other rows never, and `cache` gets them after."""
    if not decode:
        for own in writes:
            cache.update(own)
        return lambda own: cache.get
    before = dict(cache)
    for own in writes:
        cache.update(own)
    return lambda own: lambda slot: own[slot] if slot in own else before.get(slot)


def simulate(s: Scheduler, seqs: list[Sequence]) -> int:
    """Run to completion while checking every read of a fake KV cache; returns preemptions.
    A slot holds the tokens up to its position, as a real one holds K/V computed from them:
    a block shared through the prefix cache must hold the reader's own prefix."""
    bs = s.pool.page_size
    cache: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its K/V was computed from
    preemptions = 0
    for q in seqs:
        s.add(q)
    for _ in range(5000):
        if not s.has_work():
            break
        out = s.schedule()
        assert out is not None, "work left but nothing scheduled"
        preemptions += len(out.preempted)
        batch = out.feed + [q for q, _ in out.chunks]
        assert len(batch) <= s.max_num_seqs
        assert out.num_tokens <= s.max_num_batched_tokens
        assert len({q.seq_id for q in batch}) == len(batch)
        check_pool(s)
        _, p, chunks = plan(s, out)
        assert p.num_tokens == out.num_tokens
        sampled, writes = [], []
        for q, c in zip(batch, chunks, strict=True):
            assert c.seq_id == q.seq_id and c.block_table == q.block_table
            assert c.start_pos + len(c.token_ids) == q.num_computed  # advanced at schedule
            assert c.token_ids == q.token_ids[c.start_pos : c.start_pos + len(c.token_ids)]
            own = {}
            for pos in range(c.start_pos, c.start_pos + len(c.token_ids)):
                block = c.block_table[pos // bs]
                assert writable(s, block, q, pos), "a write into a shared block"
                own[block * bs + pos % bs] = tuple(q.token_ids[: pos + 1])
            writes.append(own)
        step_view = kv_step(cache, writes, out.decode)
        for q, c, own in zip(batch, chunks, writes, strict=True):
            end = c.start_pos + len(c.token_ids)
            view = step_view(own)
            for pos in range(end):  # attention reads every earlier position through the table
                slot = c.block_table[pos // bs] * bs + pos % bs
                assert view(slot) == tuple(q.token_ids[: pos + 1]), (q.seq_id, pos)
            if c.sample:
                assert c.num_generated == len(q.output_token_ids) == end - len(q.prompt_token_ids)
                sampled.append(token(c.seq_id, c.num_generated))
        s.update(out, sampled)
    assert not s.has_work()
    assert s.pool.num_pinned == 0
    return preemptions


@pytest.mark.parametrize(("num_blocks", "max_num_seqs", "max_batched", "seed"),
                         [(10, 6, 16, 0), (8, 4, 8, 1), (12, 16, 5, 2), (400, 8, 64, 3)])
@pytest.mark.parametrize("caching", [False, True])
def test_simulation_every_seq_finishes(num_blocks: int, max_num_seqs: int, max_batched: int,
                                       seed: int, caching: bool) -> None:
    """Random lengths; with caching, prompts share prefixes (a few system prompts)."""
    rng = random.Random(seed)
    s = make(num_blocks, 4, max_num_seqs, max_batched, max_model_len=min(40, num_blocks * 4),
             caching=caching)
    heads = [[rng.randrange(10, 90) for _ in range(rng.randint(0, 9))] for _ in range(3)]
    seqs = []
    for i in range(24):
        q = seq(i, rng.randint(1, 15), max_tokens=rng.randint(1, 20))
        if caching:
            q.prompt_token_ids = (rng.choice(heads) + q.prompt_token_ids)[:15]
        seqs.append(q)
    preemptions = simulate(s, seqs)
    assert (preemptions > 0) == (num_blocks < 100)  # tiny pools exercise recompute
    for q in seqs:  # same tokens however the seq was batched, chunked or preempted
        n = min(q.params.max_tokens, s.max_model_len - len(q.prompt_token_ids))
        assert q.finish_reason == "length" and q.block_table == []
        assert q.output_token_ids == [token(q.seq_id, i) for i in range(n)]
    if caching:
        assert s.kv.hits > 0
        assert s.pool.num_free + s.pool.num_cached == s.pool.num_pages
    else:
        assert s.pool.num_free == s.pool.num_pages and s.kv.queries == 0
