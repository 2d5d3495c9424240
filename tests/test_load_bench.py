"""bench/load.py's pure logic: the length sampler, the arrival schedule, the timing rules and
the statistics, on hand-made timelines whose figures are known. No Ray."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import random
import statistics

import pytest

from bench.load import (
    Chunk,
    Request,
    RequestRecord,
    arrival_times,
    benchmark,
    format_table,
    itl_gaps,
    make_requests,
    metrics_counters,
    percentile,
    prefix_hit_rate,
    run_load,
    sample_lengths,
    summarize,
)
from raygraph.protocol import RequestTiming, SamplingParams


def test_lengths_bounds_and_seed() -> None:
    xs = sample_lengths(5000, 32, 0.5, random.Random(0))
    assert all(type(x) is int for x in xs)
    assert min(xs) == 16 and max(xs) == 48  # both ends of [32*0.5, 32*1.5] are drawn
    assert abs(statistics.mean(xs) - 32) < 1
    assert sample_lengths(50, 32, 0.5, random.Random(7)) == sample_lengths(
        50, 32, 0.5, random.Random(7))
    assert sample_lengths(50, 32, 0.5, random.Random(7)) != sample_lengths(
        50, 32, 0.5, random.Random(8))


def test_lengths_exact_and_at_least_one() -> None:
    assert sample_lengths(20, 17, 0.0, random.Random(0)) == [17] * 20
    assert set(sample_lengths(200, 1, 0.9, random.Random(0))) == {1}
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError):
            sample_lengths(1, 8, bad, random.Random(0))


def test_requests_follow_the_drawn_lengths() -> None:
    a = argparse.Namespace(seed=3, num_prompts=40, input_len=20, output_len=10,
                           range_ratio=0.5, temperature=0.7, top_k=5, top_p=0.9,
                           unseeded=False, shared_prefix_len=0, num_prefixes=1)
    reqs = make_requests(a, vocab=50)
    assert reqs == make_requests(a, vocab=50)
    rng = random.Random(3)
    assert [len(r.prompt) for r in reqs] == sample_lengths(40, 20, 0.5, rng)
    assert [r.params.max_tokens for r in reqs] == sample_lengths(40, 10, 0.5, rng)
    assert all(3 <= t < 50 for r in reqs for t in r.prompt)
    assert all(r.params.ignore_eos and r.params.temperature == 0.7 for r in reqs)
    assert all(r.params.top_k == 5 and r.params.top_p == 0.9 for r in reqs)
    assert len({r.params.seed for r in reqs}) == 40
    a.unseeded = True  # as most clients send them
    assert all(r.params.seed is None for r in make_requests(a, vocab=50))


def test_arrivals() -> None:
    assert arrival_times(5, math.inf, 0) == [0.0] * 5
    assert arrival_times(100, 4.0, 1) == arrival_times(100, 4.0, 1)
    assert arrival_times(100, 4.0, 1) != arrival_times(100, 4.0, 2)
    ts = arrival_times(20001, 8.0, 0)
    assert ts[0] == 0.0 and all(b >= a for a, b in zip(ts, ts[1:]))
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert abs(statistics.mean(gaps) - 1 / 8) < 0.03 / 8
    # exponential gaps: standard deviation equals the mean (not evenly spaced)
    assert abs(statistics.pstdev(gaps) / statistics.mean(gaps) - 1) < 0.05
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 0)


def test_percentile_interpolates_like_numpy() -> None:
    xs = [50.0, 10.0, 40.0, 20.0, 30.0]
    assert percentile(xs, 50) == 30.0
    assert percentile(xs, 90) == pytest.approx(46.0)
    assert percentile(xs, 99) == pytest.approx(49.6)
    assert percentile(xs, 0) == 10.0 and percentile(xs, 100) == 50.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_itl_counts_a_gap_once_and_zeros_for_extra_tokens() -> None:
    chunks = [Chunk(1.0, 2), Chunk(1.5, 1), Chunk(1.6, 0), Chunk(2.5, 3), Chunk(2.6, 0)]
    assert itl_gaps(chunks) == pytest.approx([0.0, 0.5, 1.0, 0.0, 0.0])
    assert itl_gaps([Chunk(1.0, 1)]) == []


def test_record_ttft_tpot_e2e() -> None:
    r = RequestRecord(2, 10.0, [Chunk(10.1, 1), Chunk(10.3, 1), Chunk(10.6, 2), Chunk(10.7, 0)])
    assert r.ok and r.output_tokens == 4
    assert r.ttft == pytest.approx(0.1) and r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx(0.5 / 3)
    # the mean ITL of one request is its TPOT
    assert statistics.mean(itl_gaps(r.chunks)) == pytest.approx(r.tpot)
    # a server's own count (HTTP usage) wins over the chunks' sum
    r.chunks.append(Chunk(10.8, 0, total=5))
    assert r.output_tokens == 5 and r.tpot == pytest.approx(0.5 / 4)
    assert RequestRecord(1, 0.0, [Chunk(0.2, 1)]).tpot is None
    assert not RequestRecord(1, 0.0, [Chunk(0.2, 0)]).ok
    assert not RequestRecord(1, 0.0, [Chunk(0.2, 1)], error="boom").ok


def test_summary() -> None:
    recs = [
        RequestRecord(10, 0.0, [Chunk(0.1, 1), Chunk(0.2, 1), Chunk(0.3, 1)]),
        RequestRecord(20, 1.0, [Chunk(1.3, 1), Chunk(1.7, 1)]),
        RequestRecord(30, 1.0, [], error="RuntimeError: boom"),
    ]
    row = summarize(recs, duration=2.0)
    assert row["completed"] == 2 and row["failed"] == 1
    assert row["total_input_tokens"] == 30 and row["total_output_tokens"] == 5
    assert row["request_throughput"] == 1.0 and row["output_throughput"] == 2.5
    assert row["total_token_throughput"] == 17.5
    assert row["mean_ttft_ms"] == pytest.approx(200.0)  # 100 and 300
    assert row["p90_ttft_ms"] == pytest.approx(280.0)
    assert row["mean_tpot_ms"] == pytest.approx(250.0)  # 100 and 400
    assert row["median_itl_ms"] == pytest.approx(100.0)  # 100, 100, 400
    assert row["mean_itl_ms"] == pytest.approx(200.0)
    assert row["mean_e2el_ms"] == pytest.approx(500.0)  # 300 and 700
    assert row["mean_concurrency"] == 0.5  # 1.0 s of requests in flight over 2.0 s
    assert row["first_error"] == "RuntimeError: boom"
    empty = summarize([recs[2]], duration=1.0)
    assert empty["completed"] == 0 and empty["mean_itl_ms"] is None
    assert "mean_server_ttft_ms" not in row and "Coordinator" not in format_table(row)


def test_summary_gives_the_coordinators_own_timing_where_the_client_has_it() -> None:
    recs = [RequestRecord(10, 0.0, [Chunk(0.1, 1), Chunk(0.2, 1, None, RequestTiming(
                0.01, 0.06, 0.15))]),
            RequestRecord(10, 0.0, [Chunk(0.3, 2, None, RequestTiming(0.02, 0.2, 0.2))])]
    row = summarize(recs, duration=1.0)
    assert recs[0].timing == RequestTiming(0.01, 0.06, 0.15)
    assert row["mean_server_queue_ms"] == pytest.approx(15.0)
    assert row["median_server_ttft_ms"] == pytest.approx(130.0)  # 60 and 200
    assert row["mean_ttft_ms"] == pytest.approx(200.0)  # the client's: 100 and 300
    assert "Coordinator: submitted to first token" in format_table(row)


def test_run_load_launches_on_schedule_and_records_failures() -> None:
    async def client(prompt: list[int], params: SamplingParams):
        import time
        if prompt == [0]:
            raise RuntimeError("refused")
        for _ in range(params.max_tokens):
            await asyncio.sleep(0)
            yield Chunk(time.perf_counter(), 1)

    reqs = [Request([5, 6], SamplingParams(max_tokens=3)), Request([0], SamplingParams()),
            Request([7], SamplingParams(max_tokens=2))]
    records, duration = asyncio.run(run_load(client, reqs, [0.0, 0.0, 0.05]))
    assert [r.ok for r in records] == [True, False, True]
    assert records[1].error == "RuntimeError: refused"
    assert [r.output_tokens for r in records] == [3, 0, 2]
    assert records[2].start - records[0].start >= 0.05 and duration >= 0.05


def test_max_concurrency_caps_requests_in_flight() -> None:
    """With a cap of 2, never more than 2 clients run at once, and every request completes."""
    live, peak = [0], [0]

    async def client(prompt: list[int], params: SamplingParams):
        import time
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        try:
            for _ in range(3):
                await asyncio.sleep(0.001)
                yield Chunk(time.perf_counter(), 1)
        finally:
            live[0] -= 1

    reqs = [Request([i + 3], SamplingParams(max_tokens=3)) for i in range(7)]
    records, _ = asyncio.run(run_load(client, reqs, [0.0] * 7, max_concurrency=2))
    assert peak[0] == 2 and all(r.ok for r in records)
    records, _ = asyncio.run(run_load(client, reqs, [0.0] * 7))
    assert peak[0] == 7  # no cap: all at once


def test_timed_load_runs_with_the_client_heap_frozen() -> None:
    """The timed requests (not the warm-up) run with the client's start-up heap frozen, so a
    full collection cannot stall every stream at once; it is unfrozen afterwards."""
    frozen: dict[int, int] = {}

    async def client(prompt: list[int], params: SamplingParams):
        import time
        frozen[prompt[0]] = gc.get_freeze_count()
        yield Chunk(time.perf_counter(), 1)

    reqs = [Request([i + 3], SamplingParams(max_tokens=1)) for i in range(3)]
    warm = [Request([100], SamplingParams(max_tokens=1))]
    row = asyncio.run(benchmark(client, reqs, warm, [0.0] * 3))
    assert row["completed"] == 3
    assert all(frozen[i + 3] > frozen[100] for i in range(3))  # the warm-up ran unfrozen
    assert gc.get_freeze_count() == 0


def test_served_steps_backs_the_window_out_of_the_coordinators_means() -> None:
    from bench.serving import served_steps

    before = {"steps": 10, "steps_by_phase": {"prefill": 2, "decode": 8}, "preemptions": 1,
              "worker_step_ms": 2.0, "device_idle_ms_per_step": 0.1,
              "loop_host_ms_per_step": 0.5, "device_steps_by_phase": {"prefill": 2, "decode": 8},
              "device_s_by_phase": {"prefill": 0.004, "decode": 0.016}}
    after = {"steps": 30, "steps_by_phase": {"prefill": 5, "decode": 24, "mixed": 1},
             "preemptions": 3, "worker_step_ms": 1.5, "device_idle_ms_per_step": 0.1,
             "loop_host_ms_per_step": 0.3,
             "device_steps_by_phase": {"prefill": 2, "decode": 24, "eager": 4},
             "device_s_by_phase": {"prefill": 0.004, "decode": 0.032, "eager": 0.01}}
    assert served_steps(before, after) == {
        "served_steps": 20, "served_steps_by_phase": {"prefill": 3, "decode": 16, "mixed": 1},
        # a phase with no step in the window is left out
        "served_worker_ms_by_phase": {"decode": {"steps": 16, "ms": 1.0},
                                      "eager": {"steps": 4, "ms": 2.5}},
        "served_worker_step_ms": 1.25,  # (1.5 x 30 - 2.0 x 10) / 20
        "served_device_idle_ms_per_step": 0.1, "served_loop_host_ms_per_step": 0.2,
        "preemptions": 2}


def test_shared_prefix_prompts() -> None:
    a = argparse.Namespace(seed=3, num_prompts=10, input_len=6, output_len=4, range_ratio=0.5,
                           temperature=0.0, top_k=0, top_p=1.0, unseeded=False,
                           shared_prefix_len=0, num_prefixes=1)
    plain = make_requests(a, vocab=50)
    a.shared_prefix_len = 12
    shared = make_requests(a, vocab=50)
    head = shared[0].prompt[:12]
    assert all(r.prompt[:12] == head for r in shared)
    # the suffixes are drawn as the prompts without a prefix are: same lengths and params
    assert [len(r.prompt) - 12 for r in shared] == [len(r.prompt) for r in plain]
    assert [r.params for r in shared] == [r.params for r in plain]
    assert len({tuple(r.prompt[12:]) for r in shared}) == 10
    a.num_prefixes, a.num_prompts = 3, 40  # each request takes one of 3 at random
    several = make_requests(a, vocab=50)
    assert len({tuple(r.prompt[:12]) for r in several}) == 3
    assert several == make_requests(a, vocab=50)


class FakeSession:
    """aiohttp's session.get(url) as an async context manager, one fixed body."""

    def __init__(self, text: str, status: int = 200) -> None:
        self.text, self.status, self.urls = text, status, []

    def get(self, url: str):
        session = self

        class Response:
            status = session.status

            async def __aenter__(self):
                session.urls.append(url)
                return self

            async def __aexit__(self, *exc):
                return False

            async def text(self):
                return session.text

        return Response()


def test_prefix_hit_rate_from_counters_and_metrics_text() -> None:
    assert prefix_hit_rate((100, 20), (1100, 820)) == {
        "prefix_cache_queries": 1000, "prefix_cache_hits": 800, "prefix_cache_hit_rate": 0.8}
    assert prefix_hit_rate((5, 0), (5, 0))["prefix_cache_hit_rate"] == 0.0  # caching off
    assert prefix_hit_rate(None, (5, 0))["prefix_cache_hit_rate"] is None
    text = ("# HELP raygraph:prefix_cache_hits_total x\n"  # two replicas: summed
            'raygraph:prefix_cache_queries_total{model_name="m",replica="0"} 200.0\n'
            'raygraph:prefix_cache_queries_total{model_name="m",replica="1"} 100.0\n'
            'raygraph:prefix_cache_hits_total{model_name="m",replica="0"} 120.0\n'
            'raygraph:prefix_cache_hits_total{model_name="m",replica="1"} 0.0\n'
            'raygraph:prefix_cache_hits_created{model_name="m",replica="0"} 1.7e9\n')
    session = FakeSession(text)
    assert asyncio.run(metrics_counters(session, "http://h:1/")()) == (300.0, 120.0)
    assert session.urls == ["http://h:1/metrics"]
    assert asyncio.run(metrics_counters(FakeSession("up 1\n"), "http://h:1")()) is None
    assert asyncio.run(metrics_counters(FakeSession(text, 500), "http://h:1")()) is None
    row = summarize([RequestRecord(3, 0.0, [Chunk(0.1, 1)])], 1.0) | {"request_rate": "inf"}
    assert "Prefix cache hit rate" not in format_table(row | prefix_hit_rate(None, None))
    assert "Prefix cache hit rate:                  0.8" in format_table(
        row | prefix_hit_rate((0, 0), (10, 8)))
