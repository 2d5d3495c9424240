"""Speculative decoding's steps: sampled requests speculate reproducibly, coordinators at
TP=2, how the loop schedules verify steps, the buckets and buffers verify chunks take, and
the drafter's own timing and graph sizes."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from tests.test_speculative_served import TEXTS, served, spec_config


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_requests_speculate_reproducibly(method):
    """Seeded sampled requests with drafts (rejection sampling on the workers): drafts
    proposed and verified, max_tokens exact, and the same seeds give the same tokens again
    (the draft model: the built-in model drafting for itself)."""
    from raygraph.config import DEFAULT_MODEL

    spec = True if method == "ngram" else method
    draft = DEFAULT_MODEL if method == "draft" else ""
    runs = [served(spec, temperature=0.8, draft=draft) for _ in range(2)]
    (first, sched), (again, _) = runs
    assert sched.num_draft_tokens > 0
    assert all(len(s.output_token_ids) == 40 for s in first)
    assert [s.output_token_ids for s in first] == [s.output_token_ids for s in again]


PLAIN_TP2: list = []  # the plain coordinator's results, computed once for every method


# n-gram drafts take the same TP=2 verify path as the drafting models, with no drafter
@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow), "draft",
                                    "eagle3"])
def test_speculation_through_coordinators_at_tp2(ray_session, default_model_tp2_coord, method,
                                                 eagle3_head):
    """Requests served with speculation at TP=2 (both ranks verify alike; the draft model,
    the built-in one drafting for itself, or a random EAGLE-3 head, whose embedding is then
    read whole from the target's checkpoint, on the rank that samples): the same texts,
    token ids and finish reasons as without (the session's TP=2 coordinator; stop strings
    and max_tokens included); the drafts counted in the engine's stats. TP=1 is the
    in-process test above."""
    import msgspec

    from raygraph.config import DEFAULT_MODEL, SpeculativeConfig
    from raygraph.protocol import SamplingParams
    from tests.conftest import default_model_tp2_config, start_coordinators, stop_coordinators

    model = {"draft": DEFAULT_MODEL, "eagle3": eagle3_head}.get(method, "")
    spec_cfg = SpeculativeConfig(method=method, model=model)
    cfg = msgspec.structs.replace(default_model_tp2_config(), speculative=spec_cfg,
                                  coordinator_name=f"speculative-tp2-{method}")
    jobs = [(text, SamplingParams(max_tokens=32, temperature=0.0)) for text in TEXTS]
    jobs += [(TEXTS[1], SamplingParams(max_tokens=32, temperature=0.0, stop=[" blue"])),
             (TEXTS[0], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))]
    (spec,) = start_coordinators([cfg])
    coords = [spec] + ([] if PLAIN_TP2 else [default_model_tp2_coord])
    try:
        out = [ray_session.get([c.generate.remote(p, sp) for p, sp in jobs]) for c in coords]
        stats = ray_session.get(spec.stats.remote())
    finally:
        stop_coordinators([spec])
    PLAIN_TP2.extend(out[1:])
    spec, plain = [[(r[0].text, r[0].token_ids, r[0].finish_reason) for r in o]
                   for o in (out[0], PLAIN_TP2[0])]
    assert spec == plain
    assert plain[-1][2] == "length" and len(plain[-1][1]) == 7
    engine = stats if "spec_decode_num_draft_tokens" in stats else stats["replicas"][0]
    assert engine["spec_decode_num_draft_tokens"] > 0
    per_pos = engine["spec_decode_num_accepted_tokens_per_pos"]
    assert engine["spec_decode_num_drafts"] > 0 and len(per_pos) == 4
    assert sum(per_pos) == engine["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is kept only after the ones before
    # the time of the steps that verified: part of all steps' time; the drafter's: its own
    steps_s = engine["worker_step_ms"] * engine["steps"] / 1e3
    assert 0 < engine["spec_decode_verify_s"] <= steps_s + 1e-3
    assert (engine["spec_decode_draft_s"] > 0) == (method != "ngram")
    if "replicas" in stats:  # as /metrics shows them
        from prometheus_client.parser import text_string_to_metric_families

        from raygraph.api.metrics import Metrics

        text = Metrics("m").render(stats).decode()
        samples = {(x.name, x.labels.get("position")): x.value
                   for f in text_string_to_metric_families(text) for x in f.samples}
        assert (samples["raygraph:spec_decode_num_drafts_total", None]
                == engine["spec_decode_num_drafts"])
        assert [samples["raygraph:spec_decode_num_accepted_tokens_per_pos_total", str(i)]
                for i in range(4)] == per_pos
        assert (samples["raygraph:spec_decode_draft_time_seconds_total", None]
                == engine["spec_decode_draft_s"])
    if method == "draft":  # the model's own greedy tokens: nearly all kept
        assert (engine["spec_decode_num_accepted_tokens"]
                >= 0.9 * engine["spec_decode_num_draft_tokens"])


def test_oracle_drafts_hold_and_keep_greedy_tokens():
    """bench.speculative's oracle drafts the plain run's next tokens while the sequence's
    tokens equal them: every draft is kept (up to k a step, the full-accept path) and the
    tokens equal the plain run's, in fewer steps."""
    from bench.speculative import OracleProposer, oracles, run, speculating
    from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
    from tests.conftest import loaded_worker

    oracle = OracleProposer(3, [7, 8, 9, 10])
    oracle.extend([1, 2, 3])
    assert oracle.propose(2) == [7, 8]
    oracle.extend((7,))
    assert oracle.propose(5) == [8, 9, 10] and oracle.propose(0) == []
    oracle.extend((8, 5))  # 5, not the recorded 9: what follows is not recorded
    assert oracle.propose(2) == [] and oracle.diverged

    blocks = 64
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=64))
    worker = loaded_worker(speculating(cfg, 4), blocks, capture=True)
    rng = random.Random(0)
    ids = [[rng.randrange(3, 4096) for _ in range(n)] for n in (5, 12, 30, 17)]
    plain = run(cfg, worker, ids, 24, blocks)
    spec = run(speculating(cfg, 4), worker, ids, 24, blocks, oracles(plain["tokens"]))
    assert spec["tokens"] == plain["tokens"]
    assert spec["kept"] == spec["drafts"] > 0 and spec["steps"] < plain["steps"]


def test_speculating_sequences_verify_together_once_their_prompts_are_done():
    """Sequences whose prompts end in different steps would take turns (each sits out the
    step after its verify step, waiting for the tokens kept); the loop collects the step in
    flight first when half the batch waits on it, so at 100% acceptance each verify step
    carries every sequence: about max_tokens / (k + 1) steps after the prompts."""
    from bench.speculative import oracles, run, speculating
    from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
    from tests.conftest import loaded_worker

    blocks, budget, k, max_tokens = 64, 32, 4, 40
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=budget))
    worker = loaded_worker(speculating(cfg, k), blocks, capture=True)
    rng = random.Random(0)
    ids = [[rng.randrange(3, 4096) for _ in range(n)] for n in (5, 12, 30, 17)]
    plain = run(cfg, worker, ids, max_tokens, blocks)
    spec = run(speculating(cfg, k), worker, ids, max_tokens, blocks, oracles(plain["tokens"]))
    assert spec["tokens"] == plain["tokens"] and spec["kept"] == spec["drafts"]
    # on a CPU the device never idles: every stall is waited out, each wait's next step
    # measured as a turnaround
    assert spec["waits"] > 0 and spec["declined"] == 0 and spec["turnarounds"] > 0
    prompt_steps = -(-sum(map(len, ids)) // budget)
    assert spec["steps"] <= prompt_steps + max_tokens // (k + 1) + 1
    # max_num_seqs running: no logits row for a draft, every sequence decodes as usual and
    # none waits on the step in flight
    full = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(
        cfg.scheduler, max_num_seqs=len(ids)))
    spec = run(speculating(full, k), worker, ids, max_tokens, blocks, oracles(plain["tokens"]))
    assert spec["tokens"] == plain["tokens"] and spec["drafts"] == 0 and spec["waits"] == 0


def test_the_loop_waits_for_a_verify_step_only_while_a_turnaround_is_cheap():
    """Waiting pays until three turnarounds are measured (and on a CPU, where the device is
    the host, none is ever idle). Steps of 0.4 ms with 1.5 ms idle after each wait: it declines,
    probing again every PROBE declines. Steps of 10 ms with 1 ms turnarounds: it pays, and
    one capture-sized idle among the last five does not change that; the idle of a step not
    sent right after a wait is no turnaround."""
    from raygraph.engine.core import Turnaround
    from raygraph.protocol import StepOutput

    t = Turnaround()
    assert t.pays()

    def step(i: int, forward_s: float, idle_s: float, probe: bool = True) -> None:
        if probe:
            t.probe_step = i
        t.note(StepOutput(i, [], forward_s, idle_s))

    step(0, 4e-4, 9.0)
    assert t.pays()  # one turnaround measured decides nothing yet
    for i in range(1, 20):
        step(i, 4e-4, 1.5e-3)
    assert [t.pays() for _ in range(Turnaround.PROBE)] == [False] * (Turnaround.PROBE - 1) + [True]
    assert (t.waits, t.declined) == (3, Turnaround.PROBE)
    for i in range(20, 40):
        step(i, 1e-2, 1e-3)
    assert t.pays()
    step(40, 1e-2, 5.0)  # a capture landed in it
    assert t.pays()
    for i in range(41, 60):
        step(i, 1e-2, 9e-3, probe=False)
    assert t.pays()


def test_keep_every_draft_emits_the_drafts_then_the_target_after_them() -> None:
    """bench.speculative --keep-drafts: a verifying chunk emits its drafts, kept whatever the
    targets say, then the target's token after the last draft; other chunks their token."""
    from bench.speculative import keep_every_draft

    tokens, counts = keep_every_draft([70, 80], [1, 2, 3, 4, 90], [(0, 0, [5, 6, 7])])
    assert tokens == [5, 6, 7, 4, 80] and counts == [4, 1]


def test_verify_chunks_run_as_decode_rows_in_decode_buckets():
    """A step of plain decode rows and verify chunks (a token and its drafts) runs under a
    decode key with a row per token, each row a query at its own position: its logits equal
    those of the same chunks run prefill-shaped (a two-token prompt chunk in the batch makes
    it so), within float32 rounding; the keys say which path ran."""
    from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig, SpeculativeConfig
    from raygraph.protocol import SeqChunk, StepPlan
    from tests.conftest import loaded_worker

    blocks, bs = 32, 16
    cfg = ServeConfig(device="cpu", cache=CacheConfig(block_size=bs, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                      speculative=SpeculativeConfig(method="ngram"))
    worker = loaded_worker(cfg, blocks, capture=True)
    rng = random.Random(1)
    ids = [rng.randrange(3, 4096) for _ in range(60)]
    # sequences with their prompts cached: 30, 17 and 40 tokens, on blocks of their own
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    prompts = [ids[:30], ids[10:27], ids[20:60]]
    worker.execute(StepPlan(1, [SeqChunk(i, p, 0, t, False)
                                for i, (p, t) in enumerate(zip(prompts, tables))]))
    chunks = [SeqChunk(0, [5, 6, 7, 8, 9], 30, tables[0], True, verify=4),
              SeqChunk(1, [11], 17, tables[1], True),
              SeqChunk(2, [12, 13, 14], 40, tables[2], True, verify=2)]
    rows = worker.logits(StepPlan(2, chunks))
    assert worker.executor.last_key.phase == "decode"
    assert worker.executor.last_key.num_tokens >= len(rows) == 9
    prompt_chunk = SeqChunk(3, [1, 2], 0, [8], False)  # two tokens: the step is prefill-shaped
    again = worker.logits(StepPlan(3, [*chunks, prompt_chunk]))
    assert worker.executor.last_key.phase == "prefill"
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(rows, again, atol=1e3 * eps, rtol=1e3 * eps)


def test_verify_chunks_past_the_decode_buckets_run_prefill_shaped():
    """Drafts whose rows would pass the largest decode bucket run as a prefill-shaped step,
    keyed so by the coordinator's BucketPlan and the worker's inputs alike; within it, as
    decode rows."""
    from raygraph.graph.buckets import BucketPlan
    from raygraph.graph.inputs import host_inputs
    from raygraph.protocol import SeqChunk, StepPlan

    buckets = BucketPlan((1, 2, 4, 8), (16, 64), 8, verify=True)
    chunks = [SeqChunk(i, [1, 2, 3], 10, [0], True, verify=2) for i in range(3)]  # 9 rows
    h = host_inputs(StepPlan(0, chunks), 16, max_rows=buckets.max_verify_rows)
    assert not h.decode and buckets.key(9, 3, True).phase == "prefill"
    h = host_inputs(StepPlan(0, chunks[:2]), 16, max_rows=buckets.max_verify_rows)
    assert h.decode and h.num_seqs == 6 and buckets.key(6, 2, True).num_tokens == 8
    assert buckets.key(9, 9, True).phase == "eager"  # plain decode past them: as before
    # without speculation configured the decode graphs read no verify rows: prefill-shaped
    plain = BucketPlan((1, 2, 4, 8), (16, 64), 8)
    assert not host_inputs(StepPlan(0, chunks[:2]), 16, max_rows=plain.max_verify_rows).decode
    assert plain.key(6, 2, True).phase == "prefill"


def test_verify_rows_live_in_the_buffers_only_with_speculation():
    """Decode graphs read each row's verify_row only where speculation is configured: the
    buffers then hold the row (a plain step after a verify step writes it back to 0), and
    without it they have none, the upload being the plain layout's."""
    from raygraph.graph.inputs import InputBuffers, host_inputs
    from raygraph.protocol import SeqChunk, StepPlan

    cpu = torch.device("cpu")
    verify = StepPlan(0, [SeqChunk(0, [1, 2, 3], 10, [0], True, verify=2),
                          SeqChunk(1, [4], 5, [1], True)])
    plain = StepPlan(1, [SeqChunk(0, [1], 13, [0], True), SeqChunk(1, [4], 6, [1], True)])
    bufs = InputBuffers(16, 8, 4, cpu, verify=True)
    bufs.fill(host_inputs(verify, 16), 8, 8)
    assert bufs.verify_row[:4].tolist() == [0, 1, 2, 0]
    assert bufs.metadata(8, 8, 4, 1, 13, True).verify_row.tolist()[:4] == [0, 1, 2, 0]
    bufs.fill(host_inputs(plain, 16), 8, 8)
    assert bufs.verify_row[:4].tolist() == [0, 0, 0, 0]
    off = InputBuffers(16, 8, 4, cpu)
    assert off.verify_row is None and off.metadata(8, 8, 2, 1, 14, True).verify_row is None
    assert off.nbytes == bufs.nbytes - 16 * 8  # one int64 row of max_tokens fewer


def test_draft_spans_time_a_step_and_start_over_for_the_next():
    """The drafter's time in a step: its stretches summed, none of a previous step's."""
    import time

    from raygraph.worker.drafter import Spans

    spans = Spans(cuda=False)
    for _ in range(2):
        with spans.span():
            time.sleep(0.1)
    assert spans.seconds() >= 0.2
    assert spans.reset().seconds() == 0.0
    with spans.span():
        time.sleep(0.01)
    assert 0.01 <= spans.seconds() < 0.2


def test_a_drafters_graph_sizes_up_to_a_decode_keys_rows():
    """Background capture brings a drafter's graphs with each decode key: the sizes (powers
    of two, max_num_seqs at most) up to the key's rows, none captured twice."""
    from raygraph.config import DEFAULT_MODEL
    from tests.conftest import loaded_worker

    worker = loaded_worker(spec_config("draft", draft=DEFAULT_MODEL, max_num_seqs=6), 64)
    drafter = worker.drafter
    assert drafter.sizes_upto(1) == [1]
    assert drafter.sizes_upto(3) == [1, 2, 4]
    assert drafter.sizes_upto(100) == [1, 2, 4, 6]
    drafter.graphs.update({1: None, 2: None})  # as if captured: not again
    assert drafter.sizes_upto(5) == [4, 6]
    worker.shutdown()


def test_a_proposals_padding_rows_reach_only_the_scratch_block():
    """A graph runs a proposal's rows padded to its size, and a padding row's loop steps
    store K/V at positions 0 .. k - 1: past its first block when k is larger than a block.
    Every column those steps reach holds the scratch block, never a block an earlier
    proposal's real row left in that row of the tables (a live sequence's draft cache)."""
    import numpy as np

    from raygraph.config import DEFAULT_MODEL
    from raygraph.protocol import SeqChunk
    from tests.conftest import loaded_worker

    cfg = spec_config("draft", draft=DEFAULT_MODEL, max_num_seqs=4)
    cfg = msgspec.structs.replace(cfg, cache=msgspec.structs.replace(cfg.cache, block_size=2))
    worker = loaded_worker(cfg, 64)
    drafter = worker.drafter
    la, scratch = drafter.lookahead, drafter.first_lookahead - 1
    assert la == 3  # k = 4 over blocks of 2 tokens
    real = [SeqChunk(i, [5], 10, list(range(10 * i + 1, 10 * i + 7)), True, propose=True)
            for i in range(4)]
    none = np.zeros(0, dtype=np.int64)
    for _ in range(2):  # both host mirrors hold four real rows
        drafter._stage(real, [0, 1, 2, 3], 4, 0, none)
    drafter._stage(real[:1], [0], 4, 0, none)  # one real row, three padding rows
    assert drafter.tables[0, :6].tolist() == [1, 2, 3, 4, 5, 6]
    assert (drafter.tables[1:4, :la] == scratch).all(), drafter.tables[:4, :la]
    worker.shutdown()
