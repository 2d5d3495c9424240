"""Many concurrent clients, streaming, bad input and a dying worker, through real Ray actors."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from raygraph.client.connect import start_coordinator
from raygraph.config import CacheConfig, SchedulerConfig, ServeConfig
from raygraph.errors import BadRequest
from raygraph.protocol import SamplingParams, StreamDelta
from raygraph.requests import take_deltas
from tests.hf_ref import hf_greedy


@pytest.fixture(scope="module")
def coord(ray_session, tiny_llama):
    # a small KV cache (40 blocks of 4 tokens) so 64 concurrent requests force preemption
    cfg = ServeConfig(
        model=str(tiny_llama), device="cpu", cache=CacheConfig(block_size=4, num_blocks=40),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=120),
        coordinator_name="serving-test", step_timeout_s=30,
    )
    handle = start_coordinator(cfg)
    yield handle
    ray_session.get(handle.shutdown.remote())
    ray_session.kill(handle)


def test_64_concurrent_clients_mixed_lengths(ray_session, coord, tiny_llama):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(64)]
    lengths = [rng.randrange(1, 16) for _ in range(64)]
    refs = [coord.generate.remote(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)]
    results = [r for ref in refs for r in ray_session.get(ref)]
    expected = hf_greedy(tiny_llama, prompts, max(lengths))
    for r, exp, n in zip(results, expected, lengths):
        assert r.token_ids == exp[:n]
        assert r.finish_reason == "length"
    stats = ray_session.get(coord.stats.remote())
    assert stats["preemptions"] > 0, "the pool is sized so that preemption must happen"
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_utilization"] == 0.0
    # prefix caching is on: preempted sequences recomputed from their blocks left cached
    kv = stats["kv_cache"]
    assert kv["prefix_cache_hits"] > 0 and kv["pages"]["pinned"] == 0


BAD = [
    ([], {}, "empty prompt"),
    ([5] * 120, {}, "context holds 120"),
    ([5, 6], {"max_tokens": 0}, "max_tokens"),
    ([5, 6], {"max_tokens": "many"}, "max_tokens"),
    ([5, 6], {"top_p": 0.0}, "top_p"),
    ([5, 6], {"unknown_knob": 1}, "unknown_knob"),
    (3.5, {}, "prompts must be"),
    ([[5, "x"]], {}, "list of ints"),
    ([5, 999], {}, "outside the vocabulary"),
    ("text prompt", {}, "no tokenizer"),
    # past what msgpack or the sampler's float32 rows carry: refused, never a failed step
    ([5, 6], {"seed": 2**70}, "seed"),
    ([5, 6], {"seed": -(2**63) - 1}, "seed"),
    ([5, 6], {"seed": 2**64 - 1}, "seed"),
    ([5, 6], {"top_k": 2**64}, "top_k"),
    ([5, 6], {"stop_token_ids": [2**64]}, "stop_token_ids"),
    ([5, 6], {"temperature": 1e300}, "temperature"),
    ([5, 6], {"temperature": float("nan")}, "temperature"),
    ([5, 6], {"max_tokens": 2**63}, "max_tokens"),
]


@pytest.mark.parametrize("prompt,params,msg", BAD)
def test_bad_request_is_refused_while_others_finish(ray_session, coord, prompt, params, msg):
    restarts = ray_session.get(coord.stats.remote())["restarts"]
    good = [coord.generate.remote([7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
            for _ in range(3)]
    with pytest.raises(BadRequest, match=msg):
        ray_session.get(coord.generate.remote(prompt, params))
    for ref in good:
        (r,) = ray_session.get(ref)
        assert len(r.token_ids) == 8
    assert ray_session.get(coord.stats.remote())["restarts"] == restarts


def test_stream_equals_generate(ray_session, coord):
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3)
    (full,) = ray_session.get(coord.generate.remote([11, 12, 13], params))
    streamed = []
    gen = coord.generate_stream.options(num_returns="streaming").remote([11, 12, 13], params)
    deltas = [ray_session.get(ref) for ref in gen]
    for d in deltas:
        streamed += d.token_ids
    assert streamed == full.token_ids
    assert [d.finish_reason for d in deltas][-1] == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_seeded_sampling_is_reproducible_and_batch_independent(ray_session, coord):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=42, ignore_eos=True)
    (alone,) = ray_session.get(coord.generate.remote([20, 21, 22], params))
    crowd = ray_session.get(coord.generate.remote([[20, 21, 22], [1, 2], [9] * 30], params))
    assert crowd[0].token_ids == alone.token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=43, ignore_eos=True)
    (diff,) = ray_session.get(coord.generate.remote([20, 21, 22], other))
    assert diff.token_ids != alone.token_ids


def test_stop_token_ids(ray_session, coord, tiny_llama):
    (ref,) = hf_greedy(tiny_llama, [[30, 31, 32]], 8)
    stop_at = ref[4]
    (r,) = ray_session.get(coord.generate.remote(
        [30, 31, 32], SamplingParams(max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True)))
    assert r.finish_reason == "stop"
    assert r.token_ids == ref[: ref.index(stop_at) + 1]


def test_dead_worker_fails_requests_in_flight_then_recovers(ray_session, coord):
    from raygraph.errors import WorkerFailure

    deadline = time.time() + 120  # a background capture meeting the dead worker first
    while not ray_session.get(coord.capture_progress.remote())["done"]:  # restarts the group
        assert time.time() < deadline, "the capture schedule did not finish"
        time.sleep(0.1)
    (worker,) = ray_session.get(coord.worker_handles.remote())
    ray_session.kill(worker)
    deadline = time.time() + 60  # ray.kill is asynchronous: wait until the worker is gone
    while True:
        try:
            ray_session.get(worker.address.remote(), timeout=10)
        except ray_session.exceptions.RayActorError:
            break
        assert time.time() < deadline, "the killed worker still answers"
        time.sleep(0.1)
    # the next step meets the dead worker: the requests in it fail with a clear error
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    inflight = coord.generate.remote([[40 + i, 41] for i in range(4)], params)
    with pytest.raises(WorkerFailure, match="failed on a worker"):
        ray_session.get(inflight, timeout=60)
    # requests that arrive while the worker group restarts wait for it, then are served
    (r,) = ray_session.get(coord.generate.remote([7, 8, 9], SamplingParams(max_tokens=5)),
                           timeout=120)
    assert len(r.token_ids) >= 1
    stats = ray_session.get(coord.stats.remote())
    assert stats["healthy"] and stats["restarts"] == 1


def test_generate_from_many_async_clients(ray_session, coord):
    async def client(i: int):
        return await coord.generate.remote([i + 3] * (i % 7 + 1), SamplingParams(max_tokens=4))

    async def main():
        return await asyncio.gather(*(client(i) for i in range(32)))

    results = asyncio.run(main())
    assert all(len(r[0].token_ids) >= 1 for r in results)


def test_default_model_text_prompt_and_stop_string(ray_session, default_model_coord):
    """The built-in checkpoint with its tokenizer: text in, text out, stop strings honoured,
    and greedy tokens identical to HF transformers on the same checkpoint."""
    from raygraph.config import DEFAULT_MODEL

    handle = default_model_coord
    (r,) = ray_session.get(handle.generate.remote(
        "The import statement", SamplingParams(max_tokens=24, ignore_eos=True)))
    assert r.prompt_token_ids[0] == 0  # BOS added for text prompts
    assert hf_greedy(DEFAULT_MODEL, [r.prompt_token_ids], 24) == [r.token_ids]
    assert r.text and r.text.strip()
    stop = r.text.strip().split()[2]
    (s,) = ray_session.get(handle.generate.remote(
        "The import statement", SamplingParams(max_tokens=24, stop=[stop])))
    assert s.finish_reason == "stop" and stop not in s.text
    assert r.text.startswith(s.text)


def test_incremental_detokenizer_equals_full_decode():
    """Deltas fed token by token add up to the full decode, multi-byte characters included."""
    from raygraph.config import DEFAULT_MODEL
    from raygraph.engine.requests import Detokenizer
    from raygraph.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    rng = random.Random(5)
    texts = ["Ünïcödé → “quotes” and ✓ marks: naïve café", "The import statement\n\tx = 1"]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    seqs += [[rng.randrange(3, 4096) for _ in range(60)] for _ in range(5)]
    for ids in seqs:
        d = Detokenizer(tok, [])
        pieces = [d.update(ids[: i + 1])[0] for i in range(len(ids))]
        full = tok.decode(ids, skip_special_tokens=True)
        if not full.endswith("\ufffd"):
            assert "".join(pieces) == full == d.text
    assert "".join(Detokenizer(tok, []).update(seqs[0])[0]) == texts[0]
    d = Detokenizer(tok, ["café"])
    outs = [d.update(seqs[0][: i + 1]) for i in range(len(seqs[0]))]
    assert any(hit for _, hit in outs) and d.text == texts[0][: texts[0].index("café")]


@pytest.fixture(scope="module")
def failing(ray_session, tiny_llama):
    """One coordinator for the fault drills below: each one's group restarts and serves."""
    cfg = ServeConfig(model=str(tiny_llama), device="cpu", step_timeout_s=5,
                      cache=CacheConfig(block_size=4, num_blocks=64),
                      coordinator_name="mid-step")
    handle = start_coordinator(cfg)
    yield handle
    ray_session.get(handle.shutdown.remote())
    ray_session.kill(handle)


@pytest.mark.parametrize("kind", ["stall", "raise"])
def test_a_worker_failing_mid_step_fails_requests_then_the_group_restarts(ray_session,
                                                                          failing, kind):
    """A hang is reported within step_timeout_s, a raised step at once; the compiled step
    graph is torn down with the group and rebuilt, and requests are served again."""
    from raygraph.errors import WorkerFailure

    ray_session.get(failing.generate.remote([[5, 6, 7]], SamplingParams(max_tokens=2)))
    restarts = ray_session.get(failing.stats.remote())["restarts"]
    ray_session.get(failing.inject_fault.remote(0, kind, "step"))  # over the step graph
    t0 = time.time()
    with pytest.raises(WorkerFailure, match="did not answer within 5s" if kind == "stall"
                       else "injected fault"):
        ray_session.get(failing.generate.remote([[5, 6, 7]], SamplingParams(max_tokens=8)),
                        timeout=60)
    assert time.time() - t0 < 5 + 20
    (r,) = ray_session.get(failing.generate.remote([[7, 8, 9]], SamplingParams(max_tokens=3)),
                           timeout=120)
    assert len(r.token_ids) == 3
    assert ray_session.get(failing.stats.remote())["restarts"] == restarts + 1


def test_a_lagging_stream_takes_what_is_queued_as_one_delta():
    """Deltas queued behind the one a stream waited for go out merged (tokens, text), up to
    and including the last one; what follows a finished delta is never merged into it."""
    async def run() -> list[StreamDelta]:
        q: asyncio.Queue[StreamDelta] = asyncio.Queue()
        for d in (StreamDelta(7, [4], "b"), StreamDelta(7, [5, 6], "cd"),
                  StreamDelta(7, [8], "e", "stop"), StreamDelta(7, [9], "x")):
            q.put_nowait(d)
        first = take_deltas(q, StreamDelta(7, [3], "a"))
        return [first, take_deltas(q, await q.get())]

    merged, after = asyncio.run(run())
    assert merged == StreamDelta(7, [3, 4, 5, 6, 8], "abcde", "stop")
    assert after == StreamDelta(7, [9], "x")
