"""Prefix caching in the scheduler (engine/kv_cache.py over the PagePool): what a request
with a cached prefix computes, what stays cached, LRU eviction, counters, metrics.

Steps go through the workers' side as in test_scheduler.py (StepDelta -> SeqTable ->
StepPlan), so start positions and block tables are checked as the workers see them.
Correctness over random workloads (fake KV contents, tiny pools, preemption): the caching
runs of test_scheduler.py / test_engine.py's simulations; real models: test_served_loop.py,
tests/multirank/test_dp_ep.py.
"""

from __future__ import annotations

import argparse

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raygraph.api.metrics import Metrics
from raygraph.cli import add_serve_args, serve_config
from raygraph.config import DEFAULT_MODEL, CacheConfig, ModelConfig, ServeConfig
from raygraph.engine.core import EngineCore
from raygraph.engine.kv_cache import ALLOCATE_BUCKETS, ALLOCATE_SAMPLE, merge_stats
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.protocol import NewSeq, SamplingParams
from tests.test_scheduler import check_pool, make, step, token

SHARED = list(range(20, 30))  # 10 tokens: two full blocks of 4 and two more


def req(seq_id: int, prompt: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def run(s: Scheduler, *seqs: Sequence) -> None:
    for q in seqs:
        s.add(q)
    while s.has_work():
        step(s)
        check_pool(s)
    for q in seqs:
        assert q.output_token_ids == [token(q.seq_id, i) for i in range(q.params.max_tokens)]


def test_a_request_with_a_cached_prefix_computes_only_the_rest() -> None:
    s = make(caching=True)
    a = req(0, SHARED + [50, 51])  # 12 tokens, 3 blocks
    run(s, a)
    # a's 3 prompt blocks and the one holding its first two outputs were computed and keyed
    assert s.pool.num_cached == 3 and s.pool.num_pinned == 0
    b = req(1, SHARED + [60, 61, 62])  # shares a's first two blocks, not the third
    s.add(b)
    st = step(s)
    (c,) = st.seqs
    assert (c.start_pos, c.token_ids, c.sample) == (8, b.prompt_token_ids[8:], True)
    assert st.out.num_tokens == 5 and b.num_cached_tokens == 8 and b.num_computed == 13
    assert [(n.seq_id, n.num_computed) for n in st.delta.new] == [(1, 8)]
    assert st.delta.blocks == [(1, p) for p in b.block_table] and len(b.block_table) == 4
    assert [s.pool.page_info(p).key for p in b.block_table[:2]] == b.block_hashes[:2]
    assert (s.kv.queries, s.kv.hits) == (12 + 13, 8)
    run(s)  # b to the end
    assert b.output_token_ids == [token(1, i) for i in range(3)]


@pytest.mark.parametrize(("length", "start"), [(8, 4), (9, 8), (12, 8)])
def test_a_fully_cached_prompt_still_computes_its_last_token(length: int, start: int) -> None:
    """Its logits are sampled: the last prompt token is computed, so when the prompt ends on
    a block boundary its last block is computed again, into a private block."""
    s = make(caching=True)
    prompt = list(range(30, 30 + length))
    run(s, req(0, prompt + [7] * 4))  # every block of `prompt` is cached
    b = req(1, prompt)
    s.add(b)
    st = step(s)
    (c,) = st.seqs
    assert (c.start_pos, c.token_ids, c.sample) == (start, prompt[start:], True)
    assert b.num_cached_tokens == start and s.kv.hits == start
    last = b.block_table[-1]
    run(s)
    if length % 4 == 0:  # the recomputed block's content is cached already: it goes free
        assert s.pool.page_info(last).state == "free"


def test_finished_blocks_stay_cached_and_are_evicted_lru_from_the_tail() -> None:
    s = make(num_blocks=6, caching=True)
    a, b = req(0, range(10, 18), 1), req(1, range(40, 48), 1)  # two blocks each
    run(s, a)
    run(s, b)
    assert s.pool.num_cached == 4 and s.pool.num_free == 2
    c = req(2, range(60, 72), 1)  # needs 3 blocks: 2 free and the LRU cached one
    run(s, c)
    assert s.pool.evictions == 1
    # a's last block went first (a sequence's blocks are released tail first)
    assert s.pool.lookup(a.block_hashes[1]) is None
    assert s.pool.lookup(a.block_hashes[0]) is not None
    assert all(s.pool.lookup(h) is not None for h in b.block_hashes[:2])
    d = req(3, list(range(10, 18)) + [99], 1)  # a's prompt again: its first block is left
    s.add(d)
    (ch,) = step(s).seqs
    assert ch.start_pos == 4 and d.num_cached_tokens == 4
    run(s)


def test_caching_off_caches_nothing() -> None:
    s = make(caching=False)
    run(s, req(0, SHARED + [50, 51]))
    assert s.pool.num_free == s.pool.num_pages and s.pool.num_cached == 0
    b = req(1, SHARED + [60, 61, 62])
    s.add(b)
    (c,) = step(s).seqs
    assert c.start_pos == 0 and c.token_ids == b.prompt_token_ids and b.num_cached_tokens == 0
    run(s)
    assert s.kv.queries == s.kv.hits == 0 and s.pool.num_free == s.pool.num_pages


def test_a_burst_sharing_a_prompt_joins_the_step_that_computes_it() -> None:
    """Blocks are keyed as a step's chunks fill them: a request sharing them (a burst behind
    one system prompt, n > 1 samples) is admitted into the same step on them, and computes
    only its own tokens. The step stores every row's K/V before any row attends (it is not a
    decode step: the filling chunk has more than one token)."""
    s = make(caching=True)
    a, b = req(0, SHARED[:8]), req(1, SHARED[:8] + [5])
    d = req(3, [90, 91, 92, 93, 94])
    s.add(a), s.add(b), s.add(d)
    st = step(s)
    assert [(c.seq_id, c.start_pos) for c in st.seqs] == [(0, 0), (1, 8), (3, 0)]
    assert not st.out.decode
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [s.pool.page_info(p).key for p in a.block_table] == a.block_hashes[:2]
    assert [s.pool.page_info(p).refs for p in a.block_table[:2]] == [2, 2]
    run(s)
    assert s.pool.num_cached == 3  # a's two, and d's first block


def test_a_block_a_one_token_chunk_fills_is_shared_from_the_next_step() -> None:
    """A step whose chunks are all one token runs the decode kernel, whose rows store and
    attend in parallel: a block filled by a one-token chunk is keyed once the step is
    planned, so no row of that step reads it."""
    s = make(caching=True, max_batched=7)
    a = req(0, SHARED[:8])
    s.add(a)
    step(s)  # 7 of a's 8 tokens
    b = req(1, SHARED[:8] + [5])  # would compute one token on a's two blocks
    s.add(b)
    st = step(s)  # a's last prompt token fills its second block
    assert [(c.seq_id, len(c.token_ids)) for c in st.seqs] == [(0, 1), (1, 5)]
    assert b.num_cached_tokens == 4 and not st.out.decode
    # b computed that block too (into its own page, keyed first): later steps find one
    assert s.pool.lookup(a.block_hashes[1]) in (a.block_table[1], b.block_table[1])
    run(s)


def test_n_samples_of_one_prompt_compute_its_blocks_once() -> None:
    s = make(caching=True)
    prompt = SHARED + [7, 8, 9]  # 13 tokens: three full blocks
    samples = [req(i, prompt) for i in range(3)]
    run(s, *samples)
    assert [q.num_cached_tokens for q in samples] == [0, 12, 12]
    assert (s.kv.queries, s.kv.hits) == (3 * 13, 24)


def test_preempted_sequence_recomputes_from_the_shared_blocks() -> None:
    s = make(num_blocks=4, caching=True)
    a, b = req(0, SHARED[:8], 6), req(1, SHARED[:8] + [5], 6)
    s.add(a), s.add(b)
    step(s)  # a computes the two shared blocks
    step(s)  # a's first decode takes a 3rd block; b joins on a's two and takes the 4th
    assert b.block_table[:2] == a.block_table[:2] and s.pool.num_free == 0
    for _ in range(10):  # a's decode at position 12 needs a block: b (newest) goes
        st = step(s)
        if st.preempted:
            break
    assert st.preempted == [b] and b.block_table == [] and b.output_token_ids
    readmitted = []
    while s.has_work():
        st = step(s)
        check_pool(s)
        readmitted += [(n.seq_id, n.num_computed) for n in st.delta.new]
    # b came back on the shared blocks, still cached: it recomputed only what follows them
    assert readmitted == [(1, 8)] and b.num_cached_tokens == 8
    assert b.output_token_ids == [token(1, i) for i in range(6)]
    assert a.output_token_ids == [token(0, i) for i in range(6)]


def stats_dict(scheds: list[Scheduler]) -> dict:
    """The coordinator.stats() fields the collector reads, around the pools' merge."""
    kv = merge_stats([s.kv.stats() for s in scheds])
    return {"running": 0, "waiting": 0, "kv_utilization": kv["usage"], "kv_cache": kv,
            "prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "finished": {},
            "steps_by_phase": {}, "graphs_captured": 0, "keys_captured": 0, "capture_s": 0.0,
            "graph_pool_bytes": 0, "restarts": 0}


def test_pool_metrics_sum_dp_groups() -> None:
    groups = [make(num_blocks=6, caching=True), make(num_blocks=6, caching=True)]
    for s in groups:  # the second pass hits, then an allocation must evict
        run(s, req(0, range(10, 18), 1))
        run(s, req(1, list(range(10, 18)) + [3], 1))
        run(s, req(2, range(60, 76), 1))
    a = req(3, range(80, 84), 4)
    groups[0].add(a)
    step(groups[0])  # one sequence running in group 0 only
    stats = stats_dict(groups)
    kv = stats["kv_cache"]
    assert kv["prefix_cache_queries"] == 2 * (8 + 9 + 16) + 4
    assert kv["prefix_cache_hits"] == 2 * 8 and kv["num_pages"] == 12
    assert kv["usage"] == 1 / 6  # the fullest group: a holds 1 of its 6 blocks
    pages = kv["pages"]
    assert pages["free"] + pages["cached"] + pages["pinned"] == 12 and pages["pinned"] == 1
    assert kv["evictions"] == sum(s.pool.evictions for s in groups) > 0
    calls = sum(s.kv._allocations for s in groups)
    assert kv["allocate_seconds"]["count"] == sum(kv["allocate_seconds"]["counts"]) == sum(
        n // ALLOCATE_SAMPLE for n in (s.kv._allocations for s in groups)) and calls > 0
    # two serving replicas with these figures and one failed: a series per serving replica
    per = [{**stats, "replica": r, "state": "serving"} for r in (0, 2)]
    text = Metrics("m").render({"replicas": [per[0], {"replica": 1, "state": "failed"},
                                             per[1]]}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in fams.values() for s in f.samples}
    assert {dict(labels)["replica"] for _, labels in values} == {"0", "2"}

    def value(name: str, **labels: str) -> float:
        one, other = (values[(name, tuple(sorted({"model_name": "m", "replica": r,
                                                  **labels}.items())))] for r in "02")
        assert one == other
        return one

    assert value("raygraph:prefix_cache_queries_total") == kv["prefix_cache_queries"]
    assert value("raygraph:prefix_cache_hits_total") == 16
    assert value("raygraph:kv_cache_usage_perc") == pytest.approx(1 / 6)
    assert value("raygraph:pool_pages", state="pinned", kind="kv") == 1
    assert value("raygraph:pool_pages", state="free", kind="none") == pages["free"]
    assert value("raygraph:pool_pages", state="cached", kind="kv") == pages["cached"]
    assert value("raygraph:pool_evictions_total", kind="kv") == kv["evictions"]
    assert value("raygraph:pool_allocate_seconds_count") == kv["allocate_seconds"]["count"]
    assert value("raygraph:pool_allocate_seconds_bucket", le="+Inf") == kv[
        "allocate_seconds"]["count"]
    assert len([k for k in values if k[0] == "raygraph:pool_allocate_seconds_bucket"]) == 2 * (
        len(ALLOCATE_BUCKETS) + 1)  # per replica


def test_flag_config_and_protocol(tmp_path) -> None:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert serve_config(p.parse_args([])).cache.enable_prefix_caching
    assert not serve_config(p.parse_args(["--no-prefix-caching"])).cache.enable_prefix_caching
    toml = tmp_path / "serve.toml"  # the file's cache fields survive the flags
    toml.write_text("[cache]\nenable_prefix_caching = false\nhigh_watermark = 0.8\n"
                    "low_watermark = 0.7\n")
    c = serve_config(p.parse_args(["--config", str(toml), "--block-size", "8"])).cache
    assert (c.enable_prefix_caching, c.high_watermark, c.low_watermark, c.block_size) == (
        False, 0.8, 0.7, 8)
    cfg = ServeConfig(cache=CacheConfig(num_blocks=32, enable_prefix_caching=False))
    core = EngineCore.from_config(cfg, ModelConfig.from_pretrained(DEFAULT_MODEL), 32)
    assert not core.schedulers[0].kv.prefix_caching and core.schedulers[0].pool.num_pages == 32
    # a NewSeq without num_computed (an older sender) still decodes: it starts at 0
    old = msgspec.msgpack.encode([3, 0.0, 0, 1.0, None, 0, -1])
    assert msgspec.msgpack.decode(old, type=NewSeq).num_computed == 0
