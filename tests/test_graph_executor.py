"""The graph executor's logic on CPU (eager backend): bucketing, persistent buffers and
padding, the piecewise instruction sequence, and equality with the eager executor."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.graph import inputs
from raygraph.graph.buckets import bucket, capture_schedule, capture_sizes, default_capture_sizes
from raygraph.graph.executor import EagerExecutor, GraphExecutor
from raygraph.graph.inputs import (
    CASCADE_MIN_SEQS,
    CASCADE_MIN_TOKENS,
    InputBuffers,
    host_inputs,
    prepare_batch,
    shared_prefix_len,
)
from raygraph.protocol import BucketKey, SeqChunk, StepPlan
from raygraph.worker.worker import Worker
from tests.conftest import assert_close_across_shapes, randomise_caches

BS = 4
NUM_BLOCKS = 64


def test_default_schedule_follows_sglang_steps_and_is_capped():
    sizes = default_capture_sizes(4096)
    assert sizes[:4] == [1, 2, 4, 8] and 32 in sizes and 36 not in sizes and 48 in sizes
    assert 272 not in sizes and 288 in sizes and 576 in sizes and 1280 in sizes
    assert sizes[-1] == 4096 and sizes == sorted(set(sizes))
    assert default_capture_sizes(100)[-1] == 100  # the cap is a bucket
    assert capture_sizes([8, 2, 2, 5], 64) == [2, 5, 8]
    with pytest.raises(ValueError):
        capture_sizes([0, 4], 64)


def test_bucket_rounds_up_and_falls_back_above_the_largest():
    sizes = [1, 2, 4, 8, 16]
    assert [bucket(n, sizes) for n in (1, 3, 4, 5, 16)] == [1, 4, 4, 8, 16]
    assert bucket(17, sizes) is None
    keys = capture_schedule([1, 4, 2], [16, 8])
    assert keys == [BucketKey("decode", 4), BucketKey("decode", 2), BucketKey("decode", 1),
                    BucketKey("prefill", 16), BucketKey("prefill", 8)]


def plan_of(seqs: list[tuple[int, int]], rng: random.Random, vocab: int = 256) -> StepPlan:
    """(context already cached, new tokens) per sequence, on disjoint shuffled blocks."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    chunks = []
    for i, (ctx, n) in enumerate(seqs):
        nb = -(-(ctx + n) // BS)
        table, free = free[:nb], free[nb:]
        chunks.append(SeqChunk(i, [rng.randrange(3, vocab) for _ in range(n)], ctx, table, True))
    return StepPlan(1, chunks)


def expected_slots(plan: StepPlan) -> list[int]:
    return [c.block_table[p // BS] * BS + p % BS for c in plan.seqs
            for p in range(c.start_pos, c.start_pos + len(c.token_ids))]


def test_slots_follow_each_sequences_block_table():
    """Chunks that start mid-block and cross blocks, on scattered tables: the buffers (graph
    path) and fresh tensors (eager path) get each token's slot in its own block."""
    plan = plan_of([(5, 30), (0, 1), (17, 40), (0, 16)], random.Random(3))
    bufs = InputBuffers(max_tokens=128, max_seqs=8, max_blocks=16, device=torch.device("cpu"))
    bufs.fill(host_inputs(plan, BS), num_tokens=96, num_seqs=8)
    assert bufs.slot_mapping[:87].tolist() == expected_slots(plan)
    md = prepare_batch(plan, BS, torch.device("cpu")).ctx.attn
    assert md.slot_mapping.tolist() == expected_slots(plan)


@pytest.mark.parametrize("seqs", [[(5, 30), (0, 1), (17, 40), (0, 16)], [(7, 1), (0, 1), (3, 1)],
                                  [(0, 12)], [(9, 1), (2, 5)], [(5, 0), (0, 2)],
                                  [(5, 0), (0, 1)]])
def test_host_inputs_lay_out_each_sequences_tokens(seqs):
    """Each token's sequence, row in its chunk and absolute position (numpy, per step)."""
    h = host_inputs(plan_of(seqs, random.Random(4)), BS)
    assert h.token_seq.tolist() == [b for b, (_, n) in enumerate(seqs) for _ in range(n)]
    assert h.token_row.tolist() == [r for _, n in seqs for r in range(n)]
    assert h.positions.tolist() == [c + r for c, n in seqs for r in range(n)]
    assert h.decode == all(n == 1 for _, n in seqs)
    assert h.max_q_len == max(n for _, n in seqs)
    assert len(h.ids) == len(h.positions) == sum(n for _, n in seqs)


def test_buffers_pad_with_minus_one_slots_and_empty_sequences():
    bufs = InputBuffers(max_tokens=16, max_seqs=8, max_blocks=8, device=torch.device("cpu"))
    plan = plan_of([(5, 1), (0, 1), (9, 1)], random.Random(0))
    h = host_inputs(plan, BS)
    bufs.fill(h, num_tokens=8, num_seqs=8)
    assert bufs.slot_mapping[:3].tolist() == expected_slots(plan)
    assert (bufs.slot_mapping[3:8] == -1).all()
    assert bufs.seq_lens[:3].tolist() == [6, 1, 10] and (bufs.seq_lens[3:8] == 0).all()
    assert (bufs.block_tables[3:8] == 0).all() and (bufs.input_ids[3:8] == 0).all()
    assert bufs.token_seq[:8].tolist() == list(range(8))  # padding tokens: their own rows
    # a smaller batch later leaves nothing stale behind in its bucket
    bufs.fill(host_inputs(plan_of([(2, 1)], random.Random(1)), BS), num_tokens=4, num_seqs=4)
    assert (bufs.slot_mapping[1:4] == -1).all() and (bufs.seq_lens[1:4] == 0).all()
    assert (bufs.block_tables[1:4] == 0).all()
    with pytest.raises(ValueError, match="does not fit"):
        bufs.fill(h, num_tokens=2, num_seqs=8)


def shared_plan(lens: list[int], shared_blocks: int, bs: int = 16) -> StepPlan:
    """A decode step whose tables all start with the same `shared_blocks` blocks."""
    prefix, nxt, chunks = list(range(100, 100 + shared_blocks)), 500, []
    for i, n in enumerate(lens):
        own = -(-n // bs) - shared_blocks
        chunks.append(SeqChunk(i, [7], n - 1, prefix + list(range(nxt, nxt + own)), True))
        nxt += own
    return StepPlan(1, chunks)


def test_shared_prefix_len_counts_blocks_every_table_starts_with():
    bs, n = 16, CASCADE_MIN_SEQS
    tables = lambda plan: np.array([c.block_table + [0] * (40 - len(c.block_table))  # noqa: E731
                                    for c in plan.seqs])
    plan = shared_plan([400 + i for i in range(n)], 20)  # 20 blocks = 320 keys shared
    lens = [c.start_pos + 1 for c in plan.seqs]
    assert shared_prefix_len(tables(plan), lens, bs) == 320
    t = tables(plan)
    t[3, 18] = 9  # one table leaves the prefix at block 18: 288 keys
    assert shared_prefix_len(t, lens, bs) == 288
    t[5, 2] = 9  # at block 2: too short to pay for a cascade
    assert shared_prefix_len(t, lens, bs) == 0
    assert shared_prefix_len(tables(plan)[: n - 1], lens[: n - 1], bs) == 0  # too few rows
    # every key of the prefix comes before each sequence's newest key: a sequence of 321
    # keys has its newest at position 320, so all 20 blocks; one of 320 keys only 19
    assert shared_prefix_len(tables(plan), [321] + lens[1:], bs) == 320
    assert shared_prefix_len(tables(plan), [320] + lens[1:], bs) == 304
    assert CASCADE_MIN_TOKENS > 32 and shared_prefix_len(
        tables(shared_plan([40] * n, 2)), [40] * n, bs) == 0


def test_decode_buffers_carry_the_shared_prefix_length():
    """With the cascade on, the graph path writes the batch's shared prefix into the buffers
    (0 for prefill and for a batch without one), and decode metadata asked for the cascade
    hands the kernel its view; the eager path carries the same value, or none when nothing
    is shared. Off, nothing is computed or handed over."""
    plain = InputBuffers(max_tokens=64, max_seqs=16, max_blocks=40, device=torch.device("cpu"))
    bufs = InputBuffers(max_tokens=64, max_seqs=16, max_blocks=40, device=torch.device("cpu"),
                        cascade=True)
    plan = shared_plan([400 + 3 * i for i in range(10)], 20)
    plain.fill(host_inputs(plan, 16), num_tokens=16, num_seqs=16)
    assert plain.metadata(16, 16, 10, 1, 430, True, cascade=True).shared_len is None
    assert plain.shared_len.tolist() == [0] and plain.shared_prefix == 0
    assert prepare_batch(plan, 16, torch.device("cpu")).ctx.attn.shared_len is None
    bufs.fill(host_inputs(plan, 16), num_tokens=16, num_seqs=16)
    assert bufs.shared_len.tolist() == [320] and bufs.shared_prefix == 320
    md = bufs.metadata(16, 16, 10, 1, 430, True, cascade=True)
    assert md.shared_len is bufs.shared_len
    assert bufs.metadata(16, 16, 10, 1, 430, True).shared_len is None  # the plain graph's
    assert bufs.metadata(16, 16, 10, 1, 430, False, cascade=True).shared_len is None
    assert prepare_batch(plan, 16, torch.device("cpu"), cascade=True).ctx.attn.shared_len.tolist(
    ) == [320]
    nothing = shared_plan([400] * 10, 0)
    bufs.fill(host_inputs(nothing, 16), num_tokens=16, num_seqs=16)
    assert bufs.shared_len.tolist() == [0]
    # eager: nothing shared runs the plain kernel (its one split), as the plain graph does
    assert prepare_batch(nothing, 16, torch.device("cpu"), cascade=True).ctx.attn.shared_len \
        is None
    bufs.fill(host_inputs(plan, 16), num_tokens=16, num_seqs=16)
    prefill = StepPlan(2, [SeqChunk(0, [5] * 3, 0, [1], True)])
    bufs.fill(host_inputs(prefill, 16), num_tokens=16, num_seqs=16)
    assert bufs.shared_len.tolist() == [0]


def test_decode_steps_run_the_cascade_graph_only_when_the_batch_shares_a_prefix(
        tiny_llama, monkeypatch):
    """Decode buckets of CASCADE_MIN_SEQS+ rows are captured twice; a step runs the cascade
    graph (its metadata reads the shared length) when its batch shares a prefix, else the
    plain graph, whose kernels know nothing of a cascade. Off: one graph per key."""
    monkeypatch.setattr(inputs, "CASCADE_MIN_TOKENS", 16)  # 5 blocks of 4 are enough here
    g = make_worker(str(tiny_llama), "graph")
    ex = g.executor
    key = BucketKey("decode", CASCADE_MIN_SEQS)
    ex.capture(key)
    assert ex.cascade_graphs[key].md.shared_len is ex.bufs.shared_len
    assert ex.graphs[key].md.shared_len is None
    assert BucketKey("decode", 4) not in ex.cascade_graphs  # too few rows for a cascade
    ran = []
    for name, runner in (("plain", ex.graphs[key]), ("cascade", ex.cascade_graphs[key])):
        monkeypatch.setattr(runner, "run", lambda md, f=runner.run, n=name: (ran.append(n),
                                                                            f(md))[1])
    rng = random.Random(5)
    shared = [0, 1, 2, 3, 4]  # 20 keys in the same blocks of every table
    seqs = [SeqChunk(i, [rng.randrange(3, 256)], 20 + i % 7,
                     shared + [5 + 2 * i, 6 + 2 * i], True) for i in range(CASCADE_MIN_SEQS)]
    randomise_caches((g,), 5)
    g.executor.logits(StepPlan(1, seqs))
    assert (ran, ex.last_cascade, ex.bufs.shared_prefix) == (["cascade"], True, 20)
    g.executor.logits(plan_of([(20 + i, 1) for i in range(CASCADE_MIN_SEQS)], rng))
    assert (ran[1:], ex.last_cascade, ex.bufs.shared_prefix) == (["plain"], False, 0)
    g.executor.logits(StepPlan(2, seqs[:4]))  # shares, but too few to pay
    assert ex.last_key == BucketKey("decode", 4) and not ex.last_cascade
    off = make_worker(str(tiny_llama), "graph", cascade=False)
    off.executor.capture(key)
    assert not off.executor.cascade_graphs
    off.executor.logits(StepPlan(1, seqs))
    assert not off.executor.last_cascade and off.executor.bufs.shared_prefix == 0


def test_decode_cascade_is_on_by_default_and_a_flag_turns_it_off():
    import argparse

    from raygraph.cli import add_serve_args, serve_config

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert GraphConfig().decode_cascade and serve_config(p.parse_args([])).graph.decode_cascade
    assert not serve_config(p.parse_args(["--no-decode-cascade"])).graph.decode_cascade


def make_worker(model: str, mode: str, prefill_graph: str = "piecewise",
                cascade: bool = True) -> Worker:
    cfg = ServeConfig(
        model=model, device="cpu", cache=CacheConfig(block_size=BS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                  max_model_len=200),
        graph=GraphConfig(mode=mode, prefill_graph=prefill_graph, decode_cascade=cascade),
    )
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(NUM_BLOCKS)
    return w


@pytest.fixture(scope="module")
def workers(tiny_llama):
    return make_worker(str(tiny_llama), "graph"), make_worker(str(tiny_llama), "eager")


@pytest.fixture(scope="module")
def full_prefill(tiny_llama):
    return make_worker(str(tiny_llama), "graph", "full")


@pytest.mark.parametrize("trial", range(4))
def test_full_prefill_graph_equals_eager_and_piecewise(workers, full_prefill, trial):
    """A full prefill graph runs attention inside the bucket over a fixed number of
    sequence rows (padding rows empty): the same logits as the eager executor (within the
    cross-shape tolerance) and as the piecewise bucket of the same shape (exactly)."""
    g, e = workers
    rng = random.Random(100 + trial)
    seqs = [(rng.randrange(0, 30), rng.randrange(1, 9)) for _ in range(rng.randrange(2, 5))]
    plan = plan_of(seqs, rng)
    randomise_caches((g, e, full_prefill), trial)
    got = full_prefill.executor.logits(plan)
    key = full_prefill.executor.last_key
    assert key.phase == "prefill" and type(full_prefill.executor.graphs[key]).__name__ == \
        "FullGraph"
    assert full_prefill.executor.bufs.query_start[: len(seqs) + 1].tolist() == [
        sum(n for _, n in seqs[:i]) for i in range(len(seqs) + 1)]
    assert_close_across_shapes(got, e.executor.logits(plan))
    assert_close_across_shapes(got, g.executor.logits(plan))  # SDPA over other batch rows


@pytest.mark.parametrize("trial", range(4))
def test_graph_executor_equals_eager(workers, trial):
    g, e = workers
    rng = random.Random(trial)
    decode = [(rng.randrange(0, 40), 1) for _ in range(rng.randrange(1, 8))]
    prefill = [(rng.randrange(0, 30), rng.randrange(2, 9)) for _ in range(rng.randrange(1, 4))]
    for seqs, phase in ((decode, "decode"), (prefill, "prefill")):
        plan = plan_of(seqs, rng)
        randomise_caches((g, e), trial)
        got = g.executor.logits(plan)
        ref = e.executor.logits(plan)
        assert g.executor.last_key.phase == phase
        assert g.executor.last_key.num_tokens >= plan.num_tokens
        # a padded bucket vs the exact batch: different GEMM shapes, so rounding noise
        assert_close_across_shapes(got, ref)


@pytest.mark.parametrize("mid_prompt", [False, True])
def test_decode_step_returns_the_argmax_it_took(workers, mid_prompt):
    """Decode graphs take the greedy argmax on the device; it must be the logits' argmax,
    row for row, also when a one-token chunk mid-prompt samples nothing."""
    g, _ = workers
    rng = random.Random(21)
    plan = plan_of([(rng.randrange(0, 40), 1) for _ in range(5)], rng)
    if mid_prompt:
        plan = msgspec.structs.replace(plan, seqs=[
            msgspec.structs.replace(c, sample=i not in (1, 3)) for i, c in enumerate(plan.seqs)])
    randomise_caches((g,), 21)
    logits, greedy = g.executor.step(plan)
    assert g.executor.last_key.phase == "decode"
    assert logits.shape[0] == greedy.shape[0] == sum(s.sample for s in plan.seqs)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    assert g.executor.step(plan_of([(0, 3)], rng))[1] is None  # prefill: the sampler's argmax


def test_full_prefill_graph_takes_the_sampled_rows_logits(workers, full_prefill):
    """A full prefill graph ends in the logits and argmax of the rows the host wrote as
    sampled (one per sequence row): after a larger step left other row indices behind in
    the buffer, and with a chunk mid-prompt that samples nothing, the rows are the plan's."""
    _, e = workers
    rng = random.Random(31)
    full_prefill.executor.step(plan_of([(0, 9), (0, 9), (0, 9)], rng))  # rows 8, 17, 26
    randomise_caches((full_prefill, e), 31)
    plan = plan_of([(rng.randrange(0, 30), rng.randrange(2, 6)) for _ in range(3)], rng)
    plan = msgspec.structs.replace(plan, seqs=[
        msgspec.structs.replace(c, sample=i != 1) for i, c in enumerate(plan.seqs)])
    logits, greedy = full_prefill.executor.step(plan)
    assert full_prefill.executor.last_key.num_tokens < 27  # a smaller bucket than the last
    assert logits.shape[0] == greedy.shape[0] == 2
    assert greedy.tolist() == logits.argmax(-1).tolist()
    assert_close_across_shapes(logits, e.executor.logits(plan))


def test_above_the_largest_bucket_runs_eagerly(workers):
    g, e = workers
    plan = plan_of([(0, 20), (0, 20)], random.Random(9))  # 40 tokens > 32
    randomise_caches((g, e), 9)
    got = g.executor.logits(plan)
    assert g.executor.last_key == BucketKey("eager", 40)
    randomise_caches((g, e), 9)
    # the eager path on the real 40 tokens, as the eager worker runs them: bit for bit
    assert torch.equal(got, e.executor.logits(plan))


def test_piecewise_instruction_sequence(workers):
    g, _ = workers
    plan = plan_of([(3, 5), (0, 6)], random.Random(3))
    g.executor.logits(plan)
    key = g.executor.last_key
    runner = g.executor.graphs[key]
    layers = len(g.model.attention_layers())
    assert runner.trace == ["piece", "attention"] * layers + ["piece"]


@pytest.mark.parametrize("phase", ["decode", "prefill", "full-prefill"])
def test_padding_never_writes_a_real_kv_slot(workers, full_prefill, phase):
    g = full_prefill if phase == "full-prefill" else workers[0]
    ex: GraphExecutor = g.executor
    rng = random.Random(11)
    seqs = [(7, 1), (2, 1), (12, 1)] if phase == "decode" else [(4, 3), (0, 2)]
    plan = plan_of(seqs, rng)
    h = host_inputs(plan, BS)
    assert ex.key_for(h).num_tokens > h.num_tokens  # the bucket really pads
    sentinel = 1234.5
    for layer in g.model.attention_layers():
        layer.k_cache.fill_(sentinel)
        layer.v_cache.fill_(sentinel)
    ex.logits(plan)
    real = set(expected_slots(plan))
    for layer in g.model.attention_layers():
        for cache in (layer.k_cache, layer.v_cache):
            flat = cache.view(-1, cache.shape[2] * cache.shape[3])
            changed = {i for i in range(NUM_BLOCKS * BS) if (flat[i] != sentinel).any()}
            assert changed == real  # padding went to the scratch block, past NUM_BLOCKS


def test_eager_executor_is_the_reference_type(workers):
    assert isinstance(workers[1].executor, EagerExecutor)
    assert isinstance(workers[0].executor, GraphExecutor)


@pytest.mark.parametrize("max_seqs,prefill_graph", [(8, "piecewise"), (1, "piecewise"),
                                                    (1, "full"), (2, "full")])
def test_prefill_capture_fits_buckets_longer_than_the_context(tiny_llama, max_seqs,
                                                              prefill_graph):
    """A prefill bucket above max_model_len is captured over several dummy sequences, and
    one above every sequence at full length (max_num_seqs x max_model_len) over padding."""
    cfg = ServeConfig(model=str(tiny_llama), device="cpu",
                      cache=CacheConfig(block_size=4, num_blocks=8),
                      scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64,
                                                max_model_len=16),
                      graph=GraphConfig(decode_sizes=[1], prefill_sizes=[64],
                                        prefill_graph=prefill_graph))
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(8)
    (record,) = [r for r in w.capture_all() if r.key.phase == "prefill"]
    assert record.key == BucketKey("prefill", 64)
    assert w.executor.bufs.max_blocks * 4 < 64  # the buffers hold less than the bucket


def test_decode_graph_returns_rows_only_for_sampling_sequences(workers):
    """A one-token chunk in the middle of a prompt is decode-shaped but samples nothing."""
    g, e = workers
    plan = plan_of([(5, 1), (0, 1), (9, 1)], random.Random(3))
    plan = StepPlan(plan.step_id, [plan.seqs[0], msgspec.structs.replace(plan.seqs[1],
                                   sample=False), plan.seqs[2]])
    randomise_caches((g, e), 3)
    got, want = g.executor.logits(plan), e.executor.logits(plan)
    assert g.executor.last_key.phase == "decode" and got.shape[0] == 2
    assert_close_across_shapes(got, want)  # 3 decode rows padded to the bucket of 4


def test_capture_and_idle_padding_point_only_at_the_scratch_block(workers):
    """The GPU decode kernel stores each row's newest K/V through its block table, so the
    dummy rows of a capture (or an idle DP rank) must name the scratch block, not block 0."""
    g, _ = workers
    ex: GraphExecutor = g.executor
    scratch = g.model.attention_layers()[0].k_cache.shape[0] - 1
    assert scratch == NUM_BLOCKS  # the worker allocates it past the usable blocks
    ex.capture(BucketKey("decode", 4))
    assert (ex.bufs.block_tables[:4, 0] == scratch).all()
    assert (ex.bufs.seq_lens[:4] == 1).all() and (ex.bufs.slot_mapping[:4] == -1).all()
    ex.capture(BucketKey("prefill", 8))
    assert (ex.bufs.block_tables[:1, :2] == scratch).all()
    idle = ex.inputs(StepPlan(0, []))
    assert idle.tables == [[scratch]] and idle.sample_idx == [0]
