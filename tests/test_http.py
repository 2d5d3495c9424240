"""The HTTP front door with the official `openai` client against a real server: the default
model on CPU, the coordinator and the HTTP actor (port 0) on the test session's Ray. Over
500 lines because every route shares one served coordinator (starting one costs ~20 s)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPConnection, HTTPResponse
from urllib.parse import urlsplit

import jsonschema
import openai
import pydantic
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from raygraph.api.app import HttpConfig
from raygraph.api.chat import ChatTemplate
from raygraph.api.errors import ApiError
from raygraph.api.schemas import LOGPROB_FLOOR, Logprobs, json_text
from raygraph.api.server import start_http, stop_http
from raygraph.client.connect import start_coordinator
from raygraph.config import DEFAULT_MODEL, SchedulerConfig, ServeConfig
from raygraph.protocol import SamplingParams, TokenLogprobs
from raygraph.tokenizer import load_tokenizer

KEY = "test-key"
MODEL = "default_model"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(ray_session):
    cfg = ServeConfig(device="cpu", coordinator_name="http-test", step_timeout_s=60,
                      scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512))
    coord = start_coordinator(cfg)
    handles, url = start_http(HttpConfig(port=0, api_key=KEY, enable_sleep_routes=True),
                              cfg.coordinator_name, cfg.namespace)
    yield coord, url
    stop_http(cfg.coordinator_name, cfg.namespace)
    try:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)
    except Exception:
        pass  # the last test stopped it


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def http(url: str, method: str = "GET", body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, body, headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def raw(url: str, head: str, body: bytes = b"", timeout: float = 10) -> tuple[int, dict, float]:
    """Send `head` (request line and headers) and `body` on a fresh socket, whatever the
    server does meanwhile; (status, JSON body, seconds until the answer)."""
    u = urlsplit(url)
    t0 = time.monotonic()
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        try:
            s.sendall(head.encode() + b"\r\n" + body)
        except OSError:
            pass  # the server answered and closed before taking the rest: read its answer
        r = HTTPResponse(s)
        r.begin()
        return r.status, json.loads(r.read()), time.monotonic() - t0


def headers(path: str, *lines: str, key: str | None = KEY) -> str:
    auth = [f"Authorization: Bearer {key}"] if key else []
    return "".join(f"{ln}\r\n" for ln in (f"POST {path} HTTP/1.1", "Host: x",
                                            "Content-Type: application/json", *auth, *lines))


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels but model and replica) -> value summed over replicas.
    Every raygraph sample names its replica."""
    status, text = http(url + "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("raygraph:"):
                assert s.labels.get("replica", "").isdigit(), s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "replica"))
            name = f"{s.name}{{{labels}}}" if labels else s.name
            out[name] = out.get(name, 0.0) + s.value
    return out


def test_models_and_health(server, client):
    (m,) = client.models.list().data
    assert m.id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    status, body = http(server[1] + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    # HEAD on a GET route: its status, no body; the key is checked as for GET
    assert http(server[1] + "/health", "HEAD") == (200, "")
    auth = {"Authorization": f"Bearer {KEY}"}
    assert http(server[1] + f"/v1/models/{MODEL}", "HEAD", headers=auth) == (200, "")
    assert http(server[1] + "/v1/models", "HEAD")[0] == 401
    status, schema = http(server[1] + "/openapi.json", headers=auth)
    ids = [op["operationId"] for item in json.loads(schema)["paths"].values()
           for op in item.values()]
    assert status == 200 and len(ids) == len(set(ids))  # HEAD routes stay out of it


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_failing_mid_answer_is_a_400_naming_the_parser(server, client, stream):
    """llguidance's parser keeps 2000 items a row: 2100 alternatives fail on the first
    token. The client gets the parser's words as a 400, before any token is streamed."""
    alts = " | ".join(f'"option_{i}_end"' for i in range(2100))
    with pytest.raises(openai.BadRequestError, match="failed mid-answer"):
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, stream=stream,
                                      extra_body={"structured_outputs": {
                                          "grammar": f"start: {alts}"}})
        list(r) if stream else r
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_completion_equals_the_coordinator_and_streams_alike(ray_session, server, client):
    coord, _ = server
    prompt = "The import statement"
    (ref,) = ray_session.get(coord.generate.remote(prompt, SamplingParams(max_tokens=8,
                                                                         ignore_eos=True)))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    (choice,) = r.choices
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == 8 + r.usage.prompt_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_lists_and_token_ids(server, client):
    tok = load_tokenizer(DEFAULT_MODEL)
    ids = tok.encode("A class")  # BOS first
    r = client.completions.create(model=MODEL, prompt=["A class", "The for statement"],
                                  max_tokens=4, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 8


def test_chat_uses_the_template_streamed_and_not(server, client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the import statement?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    text = "system: Be brief.\nuser: What is the import statement?\nassistant:"
    same = client.completions.create(model=MODEL, prompt=text, max_tokens=6, **GREEDY)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == same.choices[0].text
    assert r.usage.prompt_tokens == same.usage.prompt_tokens and r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_with_top_alternatives(server, client):
    r = client.completions.create(model=MODEL, prompt="A class", max_tokens=5, logprobs=3,
                                  **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 3
        assert top[token] == logprob == max(top.values())  # greedy: the most likely

    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                 "content": "A class"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 2 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and values[0] == entry.logprob
        assert bytes(entry.bytes).decode() == entry.token

    plain = client.completions.create(model=MODEL, prompt="A class", max_tokens=3, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_n_samples_seeded_and_reproducible(server, client):
    kw = dict(model=MODEL, prompt="The for statement", max_tokens=12, n=2, temperature=1.0,
              seed=5, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seeds 5 and 6
    one = client.completions.create(**{**kw, "n": 1, "seed": 6})
    assert one.choices[0].text == a.choices[1].text
    assert a.usage.completion_tokens == 24  # both choices'; the prompt counts once
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    streamed = list(client.completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True}))
    texts = ["", ""]
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in a.choices]
    assert streamed[-1].usage.completion_tokens == a.usage.completion_tokens
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]


def test_stop_strings(server, client):
    full = client.completions.create(model=MODEL, prompt="The import statement",
                                     max_tokens=24, **GREEDY).choices[0].text
    stop = full[10:14]
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt="The import statement", max_tokens=24,
                                  stop=stop, **GREEDY)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop
    chunks = list(client.completions.create(model=MODEL, prompt="The import statement",
                                            max_tokens=24, stop=[stop, "zzz"], stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].stop_reason == stop
    assert all(c.choices[0].stop_reason is None for c in chunks[:-1])


def test_stop_reason_names_the_stop_token_and_is_none_otherwise(ray_session, server, client):
    (ref,) = ray_session.get(server[0].generate.remote([5, 6, 7], SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)))
    stop_id = next(t for i, t in enumerate(ref.token_ids) if i and t not in ref.token_ids[:i])
    kw = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0.0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert full.choices[0].stop_reason is None and full.choices[0].finish_reason == "length"
    for stream in (False, True):
        r = client.completions.create(**kw, stream=stream, extra_body={
            "ignore_eos": True, "stop_token_ids": [stop_id]})
        last = list(r)[-1].choices[0] if stream else r.choices[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop_id, last


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"prompt": []}, "empty prompt"),
    ({"prompt": [5, 99999]}, "outside the vocabulary"),
    ({"prompt": [5] * 600}, "maximum context length is"),
    ({"logprobs": 50}, "logprobs"),
]


def test_64_concurrent_streams_with_bad_requests_mixed_in(server):
    client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)

    async def good(i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"The import statement {i}", max_tokens=3 + i % 4,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return reason, chunks[-1].usage.completion_tokens

    async def bad(i: int) -> openai.BadRequestError:
        fields, _ = BAD[i % len(BAD)]
        kw = {"model": MODEL, "prompt": "A class", "max_tokens": 4, "stream": i % 2 == 0,
              **fields}
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(**kw)
        return e.value

    async def main():
        jobs = [bad(i // 8) if i % 8 == 3 else good(i) for i in range(64)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for i, r in enumerate(results):
        if i % 8 == 3:
            fields, msg = BAD[(i // 8) % len(BAD)]
            err = r.body if "error" not in r.body else r.body["error"]
            assert r.status_code == 400 and msg in err["message"], (fields, err)
            assert err["type"] == "invalid_request_error" and "param" in err and "code" in err
        else:
            assert r == ("length", 3 + i % 4)


def test_malformed_json_and_validation_errors_are_openai_400s(server):
    url = server[1] + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, body = http(url, "POST", b'{"model": "default_model", "prompt": ', auth)
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = http(url, "POST", json.dumps({"model": MODEL}).encode(), auth)
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == "prompt"
    status, body = http(url, "POST", json.dumps({"model": MODEL, "prompt": "A", "n": 0})
                        .encode(), auth)
    assert status == 400 and json.loads(body)["error"]["param"] == "n"


def test_a_wrong_or_missing_api_key_is_401(server):
    wrong = openai.OpenAI(base_url=server[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=MODEL, prompt="A class", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    body = json.dumps({"model": MODEL, "prompt": "A class"}).encode()
    status, text = http(server[1] + "/v1/completions", "POST", body,
                        {"Content-Type": "application/json"})  # no key at all
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert http(server[1] + "/health")[0] == 200  # probes need no key


def test_metrics_count_what_was_sent(server, client):
    url = server[1]
    before = scrape(url)
    usages = []
    for i in range(3):
        usages.append(client.completions.create(model=MODEL, prompt=f"A class {i}",
                                                max_tokens=2 + i, **GREEDY).usage)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, **GREEDY)
    usages.append(list(stream)[-1].usage)
    after = scrape(url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("raygraph:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("raygraph:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("raygraph:request_success_total{finished_reason=length}") == 4
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert delta(f"raygraph:{h}_count") == 4, h
    # inter-token gaps: one per token after the first
    assert delta("raygraph:inter_token_latency_seconds_count") == sum(
        u.completion_tokens - 1 for u in usages)
    assert after["raygraph:num_requests_running"] == 0
    assert after["raygraph:num_requests_waiting"] == 0
    assert after["raygraph:kv_cache_usage_perc"] == 0.0
    assert delta("raygraph:eager_steps_total") >= sum(u.completion_tokens for u in usages) / 4
    assert not any(k.startswith("raygraph:cuda_graph_replays_total") for k in after)  # CPU
    for name in ("raygraph:num_preemptions_total", "raygraph:worker_restarts_total",
                 "raygraph:cuda_graph_capture_seconds", "raygraph:graph_pool_bytes",
                 "raygraph:offload_h2d_bytes_total"):
        assert name in after


def test_a_client_that_goes_away_stops_its_stream(ray_session, server, client):
    coord = server[0]
    before = ray_session.get(coord.stats.remote())["tokens_generated"]
    stream = client.completions.create(model=MODEL, prompt="A class", max_tokens=400,
                                       stream=True, **GREEDY)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    deadline = time.monotonic() + 20
    while ray_session.get(coord.stats.remote())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = ray_session.get(coord.stats.remote())
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["tokens_generated"] - before < 400  # aborted, not run to max_tokens
    assert scrape(server[1])["raygraph:request_success_total{finished_reason=abort}"] >= 1


def test_a_cancelled_subscribed_stream_leaves_nothing_behind(server):
    """StreamHub over a real engine: a cancelled request stops, its deltas still in
    flight are dropped, and the coordinator's closing "abort" delta clears its record, so
    nothing is kept per cancelled request; the others on the subscription go on."""
    from raygraph.client.streams import StreamHub

    engine = ray.get(server[0].engine.remote(0))  # HTTP servers stream from the engines

    async def run() -> tuple[StreamHub, list[int]]:
        hub = StreamHub(engine)
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        gone = await hub.open([5, 6, 7], params)
        kept = await hub.open([5, 6, 8], SamplingParams(max_tokens=8, ignore_eos=True))
        await hub.next(gone)
        hub.cancel([gone])
        tokens = []
        while True:
            d = await hub.next(kept)
            tokens += d.token_ids
            if d.finish_reason is not None:
                break
        hub.cancel([kept])  # finished and read: nothing to cancel, nothing kept
        short = await hub.open([5, 6, 9], SamplingParams(max_tokens=1, ignore_eos=True))
        deadline = time.monotonic() + 20
        while short not in hub._ended and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        hub.cancel([short])  # finished, its last delta unread: no abort will come for it
        while hub._cancelled and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return hub, tokens

    hub, tokens = asyncio.run(run())
    assert len(tokens) == 8
    assert hub._cancelled == set() and hub.queues == {} and hub._ended == set()


def test_tokens_before_a_stream_failure_go_out_before_the_error():
    """A failure queued behind tokens not read yet: the tokens come first, then the error
    alone (the hub never hands out generated text with the failure)."""
    from raygraph.client.streams import StreamHub
    from raygraph.errors import WorkerFailure
    from raygraph.protocol import StreamDelta

    async def run() -> tuple[StreamDelta, str]:
        hub = StreamHub(None)
        for d in (StreamDelta(7, [4], "ab"), StreamDelta(7, [], None, "error", error="boom")):
            hub._queue(7).put_nowait(d)
        first = await hub.next(7)
        with pytest.raises(WorkerFailure) as e:
            await hub.next(7)
        return first, str(e.value)

    first, error = asyncio.run(run())
    assert first == StreamDelta(7, [4], "ab") and error == "boom"


def test_a_burst_of_opens_with_a_bad_prompt_serves_the_others(server):
    """One submit_streams call for the burst: the prompt longer than the context is refused
    with BadRequest, alone; the others stream all their tokens."""
    from raygraph.client.streams import StreamHub
    from raygraph.errors import BadRequest

    engine = ray.get(server[0].engine.remote(0))

    async def run() -> list:
        hub = StreamHub(engine)
        sp = SamplingParams(max_tokens=5, ignore_eos=True)
        prompts = [[5, 6, 7], [9] * 4096, [5, 6, 8], [5, 6, 9]]
        opened = await asyncio.gather(*(hub.open(p, sp) for p in prompts),
                                      return_exceptions=True)
        for rid in (r for r in opened if isinstance(r, int)):
            n = 0
            while True:
                d = await hub.next(rid)
                n += len(d.token_ids)
                if d.finish_reason is not None:
                    break
            assert n == 5
        return opened

    opened = asyncio.run(run())
    assert isinstance(opened[1], BadRequest) and "context holds" in str(opened[1])
    assert all(isinstance(opened[i], int) for i in (0, 2, 3))


def test_sleep_and_wake_endpoints(server, client):
    url = server[1]
    auth = {"Authorization": f"Bearer {KEY}"}
    assert http(url + "/is_sleeping")[0] == 401
    status, body = http(url + "/is_sleeping", headers=auth)
    assert status == 200 and json.loads(body) == {"is_sleeping": False}
    assert http(url + "/sleep?level=3", "POST", b"", auth)[0] == 400
    assert http(url + "/sleep", "POST", b"")[0] == 401
    busy = client.completions.create(model=MODEL, prompt="A class", max_tokens=400,
                                     stream=True, **GREEDY)
    next(iter(busy))
    status, body = http(url + "/sleep?level=1&wait=false", "POST", b"", auth)
    busy.close()  # aborts it
    assert status == 409 and json.loads(body)["error"]["code"] == "busy", body
    status, body = http(url + "/sleep?level=1", "POST", b"", auth)
    if status != 200:
        pytest.skip(f"the coordinator cannot sleep on this machine: {status} {body}")
    try:
        assert json.loads(http(url + "/is_sleeping", headers=auth)[1]) == {"is_sleeping": True}
        status, body = http(url + "/health")
        assert status == 503 and "asleep" in json.loads(body)["reason"]
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="A class", max_tokens=2)
        assert e.value.status_code == 503 and "POST /wake_up" in str(e.value)
    finally:
        status, body = http(url + "/wake_up", "POST", b"", auth)
    assert status == 200, body
    assert http(url + "/health")[0] == 200
    assert client.completions.create(model=MODEL, prompt="A class", max_tokens=2).usage


def test_the_key_is_checked_before_the_body_is_read(server):
    """A client without the key is refused from its headers: a 100 MB body announced (and
    started) gets its 401 at once, and so does a malformed body (not a 400)."""
    url = server[1]
    head = headers("/v1/completions", f"Content-Length: {100 * 2**20}", key=None)
    status, body, seconds = raw(url, head, b"x" * 2**16)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and seconds < 1
    status, body, _ = raw(url, headers("/v1/completions", "Transfer-Encoding: chunked",
                                       key="wrong"), b"10000\r\n" + b"x" * 2**16)
    assert status == 401
    status, text = http(url + "/v1/completions", "POST", b'{"prompt": ',
                        {"Content-Type": "application/json"})
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"


def test_a_body_over_max_request_bytes_is_413(server):
    """Announced: refused before it is read; chunked: refused once what was read passes the
    limit (16 MiB by default)."""
    url = server[1]
    status, body, seconds = raw(url, headers("/v1/completions", f"Content-Length: {10**8}"),
                                b"x" * 2**16)
    assert status == 413 and body["error"]["code"] == "request_too_large" and seconds < 1
    chunk = b"x" * 2**20
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(17))
    status, body, _ = raw(url, headers("/v1/completions", "Transfer-Encoding: chunked"),
                          chunks, timeout=30)
    assert status == 413 and "max-request-bytes" in body["error"]["message"]
    status, text = http(url + "/v1/completions", "POST", json.dumps(
        {"model": MODEL, "prompt": "A class", "max_tokens": 2}).encode(),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert status == 200, text  # an ordinary body passes


def test_keep_alive_requests_are_not_held_by_nagle(server):
    """Responses go out in two writes (headers, body): without TCP_NODELAY on the accepted
    socket the second waits for the client's delayed ACK (~40 ms) on a reused connection."""
    u = urlsplit(server[1])
    conn = HTTPConnection(u.hostname, u.port, timeout=10)
    seconds = []
    for _ in range(20):
        t0 = time.perf_counter()
        conn.request("GET", "/is_sleeping", headers={"Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read()) == {"is_sleeping": False}
        seconds.append(time.perf_counter() - t0)
    conn.close()
    # half the delayed ACK: a busy 2-core machine's noise (up to ~11 ms seen) stays under it
    assert statistics.median(seconds[5:]) < 0.020, seconds


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A 2 MB text prompt is tokenized on the app's worker thread: /health answers in the
    meantime (the prompt is then over the context: 400)."""
    url = server[1]
    body = json.dumps({"model": MODEL, "prompt": "The import statement. " * 95_000,
                       "max_tokens": 2}).encode()
    out: list = []
    sender = threading.Thread(target=lambda: out.append(http(
        url + "/v1/completions", "POST", body,
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})))
    sender.start()
    probes = []
    while sender.is_alive():
        t0 = time.perf_counter()
        assert http(url + "/health")[0] == 200
        probes.append(time.perf_counter() - t0)
        time.sleep(0.02)
    sender.join()
    status, text = out[0]
    assert status == 400 and "maximum context length" in json.loads(text)["error"]["message"]
    assert len(probes) >= 3 and max(probes) < 0.5, probes


def test_long_prompts_do_not_hold_up_a_short_one(server):
    """Two 4 MB prompts (each seconds of tokenizing) are sent first: they queue in the bulk
    lane, so a short completion sent after them is answered before either."""
    url = server[1]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = json.dumps({"model": MODEL, "prompt": "The import statement. " * 190_000,
                      "max_tokens": 2}).encode()
    small = json.dumps({"model": MODEL, "prompt": "The import", "max_tokens": 2}).encode()
    done: list[tuple[str, int]] = []

    def send(name: str, body: bytes) -> None:
        done.append((name, http(url + "/v1/completions", "POST", body, auth)[0]))

    bigs = [threading.Thread(target=send, args=("big", big)) for _ in range(2)]
    for t in bigs:
        t.start()
    time.sleep(0.2)  # both are read and tokenizing
    send("small", small)
    for t in bigs:
        t.join()
    assert done == [("small", 200), ("big", 400), ("big", 400)], done


def test_a_client_that_goes_away_aborts_its_whole_response(ray_session, server):
    """Non-streaming: the connection closes while the response is computed; the
    coordinator call is cancelled, its request counted as an abort, and generation stops."""
    coord, url = server
    before = ray_session.get(coord.stats.remote())
    u = urlsplit(url)
    body = json.dumps({"model": MODEL, "prompt": "A class", "max_tokens": 400,
                       "ignore_eos": True}).encode()
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(headers("/v1/completions", f"Content-Length: {len(body)}").encode()
                  + b"\r\n" + body)
        deadline = time.monotonic() + 20
        while (ray_session.get(coord.stats.remote())["tokens_generated"]
               == before["tokens_generated"] and time.monotonic() < deadline):
            time.sleep(0.02)
    deadline = time.monotonic() + 20
    while ray_session.get(coord.stats.remote())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = ray_session.get(coord.stats.remote())
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["finished"].get("abort", 0) == before["finished"].get("abort", 0) + 1
    time.sleep(0.3)
    after = ray_session.get(coord.stats.remote())["tokens_generated"]
    assert after == stats["tokens_generated"] < before["tokens_generated"] + 400


def test_context_length_is_checked_when_max_tokens_is_given(server, client):
    """Prompt plus a given max_tokens over the context: OpenAI's context_length_exceeded;
    without max_tokens a chat generates until the context ends."""
    for call in (lambda: client.completions.create(model=MODEL, prompt="A class",
                                                   max_tokens=2**31 - 1),
                 lambda: client.chat.completions.create(
                     model=MODEL, messages=[{"role": "user", "content": "A class"}],
                     max_completion_tokens=100_000)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
        assert "maximum context length is" in err["message"]


def test_fields_asking_for_unbuilt_features_are_400s_not_ignored(server, client, ray_session):
    """logit_bias, the old function-calling fields, tools on completions and image parts: a
    400 naming the field before any compute; the values that ask for nothing (OpenAI's
    defaults) are served."""
    coord, _ = server
    before = ray_session.get(coord.stats.remote())["requests_started"]
    msgs = [{"role": "user", "content": "A class"}]
    asks = [("logit_bias", {"5": 100}), ("functions", [{"name": "f"}]),
            ("function_call", {"name": "f"})]
    for field, value in asks:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           extra_body={field: value})
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # tools: the chat route's only
        client.completions.create(model=MODEL, prompt="A class", max_tokens=2,
                                  extra_body={"tools": [WEATHER_TOOL]})
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}])
    assert ray_session.get(coord.stats.remote())["requests_started"] == before  # no compute
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                         response_format={"type": "text"}, tool_choice="none")
    assert out.choices[0].message.content is not None


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10**7)
    coastal: bool


def test_structured_outputs_with_the_official_client(server, client, ray_session):
    """`chat.completions.parse` with a pydantic model, json_object, vLLM's extra fields,
    streamed and not: outputs parse. A bad schema or two constraints: a 400 before any
    compute."""
    msgs = [{"role": "user", "content": "A city as JSON"}]
    out = client.chat.completions.parse(model=MODEL, messages=msgs, max_tokens=80,
                                        response_format=City, temperature=0)
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and out.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80,
                                         response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    code = {"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}}
    stream = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, stream=True,
                                       extra_body=code)
    streamed = "".join(c.choices[0].text for c in stream)
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", streamed), streamed
    pick = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5,
                                     extra_body={"guided_choice": ["left", "right"]})
    assert pick.choices[0].text in ("left", "right")
    coord, _ = server
    before = ray_session.get(coord.stats.remote())["requests_started"]
    bad = [({"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "bogus"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "json_schema.schema"),
           ({"structured_outputs": {"regex": "a(b"}}, "regex"),
           ({"guided_regex": "a+", "guided_choice": ["a"]}, "one output constraint")]
    for extra, words in bad:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           extra_body=extra)
    assert ray_session.get(coord.stats.remote())["requests_started"] == before  # no compute


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
    "required": ["zone"], "additionalProperties": False}}}


def check_calls(calls: list, names: set[str]) -> None:
    """Each call names one of `names` and its arguments validate against that tool."""
    schemas = {t["function"]["name"]: t["function"]["parameters"]
               for t in (WEATHER_TOOL, TIME_TOOL)}
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def streamed_calls(stream) -> tuple[list, str | None, str]:
    """A chat stream's tool-call deltas reassembled as OpenAI's client users do: by index,
    arguments concatenated; with the finish_reason and the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    out = [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function",
        function={"name": c["name"], "arguments": c["arguments"]}) for c in calls.values()]
    return out, finish, content


def test_tool_calls_with_each_tool_choice_streamed_and_not(server, client):
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools = [WEATHER_TOOL, TIME_TOOL]
    kw = {"model": MODEL, "messages": msgs, "tools": tools, "max_tokens": 120,
          "temperature": 0}
    out = client.chat.completions.create(tool_choice="required", **kw)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls, {"get_weather", "get_time"})
    calls, finish, _ = streamed_calls(client.chat.completions.create(
        tool_choice="required", stream=True, **kw))
    assert finish == "tool_calls"
    check_calls(calls, {"get_weather", "get_time"})
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    named = {"type": "function", "function": {"name": "get_time"}}
    one = client.chat.completions.create(tool_choice=named, parallel_tool_calls=False, **kw)
    assert len(one.choices[0].message.tool_calls) == 1
    check_calls(one.choices[0].message.tool_calls, {"get_time"})
    for choice in ("auto", "none"):  # the tiny model answers in text
        text = client.chat.completions.create(tool_choice=choice, **kw).choices[0]
        assert text.message.tool_calls is None and text.finish_reason in ("stop", "length")
        _, finish, content = streamed_calls(client.chat.completions.create(
            tool_choice=choice, stream=True, **kw))
        assert content == text.message.content and finish == text.finish_reason


def test_a_two_turn_tool_loop(server, client):
    """Call, tool result, final answer: the result goes back through the template."""
    msgs = [{"role": "user", "content": "Weather in Oslo, then tell me."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=120)
    message = first.choices[0].message
    (call,) = message.tool_calls
    msgs += [message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 3}'}]
    final = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL],
                                           max_tokens=16, temperature=0)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 10  # call + result in it


def test_reasoning_content_is_split_from_the_answer(server):
    """A <think> part comes back as reasoning_content, whole and streamed; the answer as
    content. A second server on the same coordinator, with qwen3's parser; the thinking is
    written by the request's own grammar (the tiny model has none), which, being the
    client's, constrains the whole answer."""
    name = "http-test-reasoning"
    _, url = start_http(HttpConfig(port=0, api_key=KEY, reasoning_parser="qwen3"),
                        "http-test", ServeConfig().namespace, name=name)
    try:
        check_reasoning(openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0))
    finally:
        stop_http(name, ServeConfig().namespace)


def check_reasoning(client: openai.OpenAI) -> None:
    shape = ('start: "<think>" /[a-z]{2,8}( [a-z]{2,8}){0,3}/ "</think>\\n\\n" '
             '/[A-Z][a-z]{1,8}\\./')
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 60,
          "extra_body": {"structured_outputs": {"grammar": shape}}, "temperature": 0}
    msg = client.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){0,3}", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z]{1,8}\.", msg.content), msg.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_the_responses_api_streamed_and_not(server, client):
    """`client.responses.create`: text, streamed events that add up to the same text, a JSON
    schema via text.format, a function call and its output sent back; stored responses
    are refused."""
    kw = {"model": MODEL, "instructions": "Answer briefly.", "temperature": 0,
          "max_output_tokens": 12}
    r = client.responses.create(input="The import statement", **kw)
    assert r.status == "incomplete" and r.output_text and r.usage.output_tokens == 12
    events = list(client.responses.create(input="The import statement", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "digit", "schema": schema}}
    js = client.responses.create(input="A digit", text=fmt, model=MODEL, max_output_tokens=20)
    jsonschema.validate(json.loads(js.output_text), schema)
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    call = client.responses.create(input="Weather in Oslo?", tools=[tool],
                                   tool_choice="required", parallel_tool_calls=False,
                                   model=MODEL, max_output_tokens=80)
    (fc,) = [o for o in call.output if o.type == "function_call"]
    jsonschema.validate(json.loads(fc.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed = list(client.responses.create(input="Weather in Oslo?", tools=[tool],
                                            tool_choice="required", stream=True,
                                            parallel_tool_calls=False, model=MODEL,
                                            max_output_tokens=80))
    (done,) = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done.type == "function_call" and json.loads(done.arguments)
    final = client.responses.create(model=MODEL, tools=[tool], max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
         "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp_c": 3}'}])
    assert final.output_text and final.usage.input_tokens > call.usage.input_tokens
    for extra, words in [({"previous_response_id": "resp_1"}, "stores no responses"),
                         ({"tools": [{"type": "web_search"}]}, "only function tools"),
                         ({"input": [{"role": "user", "content": ["hi"]}]}, "an object"),
                         ({"input": [{"role": "user", "content": 5}]}, "text or a list"),
                         ({"text": {"format": "json"}}, "text.format")]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.responses.create(input="x", model=MODEL, extra_body=extra)
    with pytest.raises(openai.BadRequestError):  # a malformed call in a chat history
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "assistant", "tool_calls": [{"function": "x"}]}])


def test_unknown_routes_methods_and_bodies_get_openai_errors(server):
    url = server[1]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for (method, path, body), want in [(("GET", "/v1/nope", None), 404),
                                       (("GET", "/v1/completions", None), 405),
                                       (("POST", "/v1/completions", b"[1, 2]"), 400),
                                       (("POST", "/v1/completions", b"\xff\xfe"), 400),
                                       (("POST", "/v1/chat/completions", b"{}"), 400)]:
        status, text = http(url + path, method, body, auth)
        err = json.loads(text)["error"]
        assert status == want and set(err) == {"message", "type", "param", "code"}, text


def test_logprobs_are_finite_json():
    """-inf (a filtered token) and NaN become vLLM's -9999.0: the JSON stays valid."""
    nan, inf = float("nan"), float("inf")
    lps = [TokenLogprobs(nan, [3, 4], [-inf, nan]), TokenLogprobs(-inf), TokenLogprobs(-0.5)]
    out = Logprobs(None).completion([1, 2, 3], lps)
    assert out["token_logprobs"] == [LOGPROB_FLOOR, LOGPROB_FLOOR, -0.5]
    assert out["top_logprobs"][0] == {"token_id:3": LOGPROB_FLOOR, "token_id:4": LOGPROB_FLOOR,
                                      "token_id:1": LOGPROB_FLOOR}
    chat = Logprobs(None).chat([1, 2, 3], lps)
    values = [e["logprob"] for e in chat["content"]]
    values += [t["logprob"] for e in chat["content"] for t in e["top_logprobs"]]
    assert all(math.isfinite(v) for v in values)
    assert json.loads(json_text(out)) == out and json.loads(json_text(chat)) == chat
    with pytest.raises(ValueError):
        json_text({"logprob": nan})


def test_api_servers_share_one_port(ray_session, server):
    """--api-server-count 2: two HTTP actors on one port (SO_REUSEPORT), one coordinator;
    requests on fresh connections all succeed; stop_http stops both."""
    coord, _ = server
    name, ns = "replica-test", "raygraph"
    handles, url = start_http(HttpConfig(port=0, replicas=2), "http-test", ns, name=name)
    assert len(handles) == 2
    ray_session.get_actor(f"{name}-http-1", namespace=ns)  # the second replica is there
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                       "ignore_eos": True, "stream": True}).encode()
    for _ in range(12):  # urllib opens a new connection each time: the kernel spreads them
        status, text = http(url + "/v1/completions", "POST", body,
                            {"Content-Type": "application/json"})
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert stop_http(name, ns)
    with pytest.raises(ValueError):
        ray_session.get_actor(f"{name}-http-1", namespace=ns)


def test_a_stream_that_fails_after_its_200_ends_with_one_error_event(ray_session, server):
    """A worker step raises mid-stream: the tokens sent so far stay, then one OpenAI error
    event carrying the error alone (no generated text), then [DONE]; the group restarts."""
    coord, url = server
    u = urlsplit(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "A class", "max_tokens": 400, "ignore_eos": True,
         "stream": True}), {"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    events = [r.readline(), r.readline()]  # the first chunk and its blank line
    ray_session.get(coord.inject_fault.remote(0, "raise", "step"))
    events += r.readlines()
    conn.close()
    data = [e[len(b"data: "):].strip() for e in events if e.startswith(b"data: ")]
    assert data[-1] == b"[DONE]"
    chunks, (error,) = [json.loads(d) for d in data[:-1] if b'"error"' not in d], [
        json.loads(d)["error"] for d in data[:-1] if b'"error"' in d]
    assert data[-2] == json_text({"error": error}).encode()  # the last event before [DONE]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text and text not in error["message"] and "injected fault" in error["message"]
    assert error["type"] == "server_error" and error["code"] == "worker_failure"
    deadline = time.monotonic() + 120
    while http(url + "/health")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_session.get(coord.stats.remote())["restarts"] == 1
    assert http(url + "/health")[0] == 200


def test_a_responses_stream_that_fails_ends_with_error_and_response_failed(ray_session,
                                                                            server):
    """The Responses API's own ending for a failure after the 200: an `error` event, then
    `response.failed` (status failed, the error, the items finished so far)."""
    coord, url = server
    u = urlsplit(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/responses", json.dumps(
        {"model": MODEL, "input": "A class", "max_output_tokens": 400, "stream": True}),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    lines = []
    while not any(b"output_text.delta" in line for line in lines):
        lines.append(r.readline())
    ray_session.get(coord.inject_fault.remote(0, "raise", "step"))
    lines += r.readlines()
    conn.close()
    events = [json.loads(line[len(b"data: "):]) for line in lines if line.startswith(b"data: ")]
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "worker_failure"
    assert "injected fault" in error["message"]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "worker_failure",
                                           "message": error["message"]}
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    deadline = time.monotonic() + 120
    while http(url + "/health")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert http(url + "/health")[0] == 200


def test_health_is_503_once_the_coordinator_stops(ray_session, server, client):
    """Last in the module: it stops the coordinator."""
    coord, url = server
    ray_session.get(coord.shutdown.remote())
    status, body = http(url + "/health")
    assert status == 503 and "shut down" in json.loads(body)["reason"]
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="A class", max_tokens=2)
    assert e.value.status_code == 503
    ray_session.kill(coord)  # asynchronous: a call may still reach it for a moment
    deadline = time.monotonic() + 30
    while True:
        status, body = http(url + "/health")
        if "gone" in json.loads(body)["reason"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 503 and "gone" in json.loads(body)["reason"]


def test_chat_without_a_template_is_refused_and_a_given_one_is_used(tmp_path):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(f"{DEFAULT_MODEL}/{name}", tmp_path / name)
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(ApiError) as e:
        ChatTemplate(tok, str(tmp_path)).render([{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and "no chat template" in e.value.message
    given = ChatTemplate(tok, str(tmp_path), "{% for m in messages %}<{{ m['content'] }}>"
                         "{% endfor %}{% if add_generation_prompt %}!{% endif %}")
    ids = given.render([{"role": "user", "content": "hi"}])
    assert ids == tok.encode("<hi>!", add_special_tokens=False)  # the template adds no BOS


def test_a_client_gone_before_its_answer_is_a_499_and_its_calls_are_cancelled(ray_session):
    """A non-streamed request whose client disconnects ends as ClientGone (499) at once,
    its coordinator calls cancelled, not as a 500 from reading a gather still cancelling."""
    from raygraph.api.front import ClientGone, Front

    @ray.remote
    class Slow:
        async def generate(self, prompts, params):
            await asyncio.sleep(60)

    class Fake:  # what Front.generate reads of its front
        coord = Slow.remote()

    async def receive():
        return {"type": "http.disconnect"}

    async def call():
        with pytest.raises(ClientGone):  # the call sleeps 60 s: a hang guard, not a timing
            await asyncio.wait_for(
                Front.generate(Fake(), [(0, [1, 2], SamplingParams(seed=1))], receive), 30)

    asyncio.run(call())
    ray.kill(Fake.coord)


def test_a_stream_that_fails_before_reading_its_deltas_still_stops_them():
    """An SSE stream whose events fail before its engine streams are read (its first
    events could not be encoded) ends with one error event and [DONE], and its streams
    are stopped: a generator closed before it started runs no cleanup of its own."""
    from raygraph.api.app import _guard
    from raygraph.api.front import Merged

    stopped = []

    async def deltas():
        yield 0, None

    async def events():
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        yield b""

    async def run():
        return [e async for e in _guard(events(), Merged(deltas(), lambda: stopped.append(1)))]

    out = asyncio.run(run())
    assert stopped == [1] and b"surrogates" in out[0] and out[-1].strip() == b"data: [DONE]"


def test_a_stream_ends_as_its_api_ends_one_even_at_its_first_event():
    """The Responses API ends a failed stream with its own events, not chat's error and
    [DONE]: `_guard` hands the error to the stream's ending wherever it failed, its first
    event included, and stops its engine streams."""
    from raygraph.api.app import _guard
    from raygraph.api.front import Merged

    stopped, seen = [], []

    async def deltas():
        yield 0, None

    async def events():
        raise RuntimeError("the response object could not be built")
        yield b""

    def failed(err: ApiError) -> list[bytes]:
        seen.append(err)
        return [b"event: error\n", b"event: response.failed\n"]

    async def run():
        return [e async for e in _guard(events(), Merged(deltas(), lambda: stopped.append(1)),
                                        failed)]

    out = asyncio.run(run())
    assert out == [b"event: error\n", b"event: response.failed\n"] and stopped == [1]
    assert seen[0].status == 500 and "could not be built" in seen[0].message


def test_what_a_chat_template_writes_counts_toward_the_bulk_lane():
    """A chat request tokenizes in the bulk lane when its template has much to write: long
    tools or kwargs, or many messages (each costs the template its markers), not only
    long message text."""
    from raygraph.api.app import template_size
    from raygraph.api.front import BULK_CHARS, MESSAGE_CHARS, text_size

    assert text_size([{"role": "user", "content": "hi"}]) == 2 + MESSAGE_CHARS
    assert text_size([{"role": "user", "content": ""}] * (BULK_CHARS // MESSAGE_CHARS)) \
        >= BULK_CHARS
    assert template_size(None, None) == 0
    tool = {"type": "function", "function": {"name": "f", "description": "x" * BULK_CHARS}}
    assert template_size([tool], None) >= BULK_CHARS
    deep: dict = {}
    for _ in range(5000):
        deep = {"a": deep}
    assert template_size(None, deep) == BULK_CHARS


def test_a_failed_seed_group_cancels_the_requests_other_calls(ray_session):
    """Choices with different seeds go in separate coordinator calls: when one fails, the
    request fails and its other calls are cancelled, not left generating for no one."""
    from raygraph.api.front import Front

    @ray.remote
    class Coordinator:
        def __init__(self):
            self.cancelled = False

        async def generate(self, prompts, params):
            if params.seed == 1:
                raise ValueError("this group failed")
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled = True
                raise

        def was_cancelled(self):
            return self.cancelled

    class Fake:  # what Front.generate reads of its front
        coord = Coordinator.remote()

    async def receive():
        await asyncio.sleep(3600)

    async def call():
        with pytest.raises(Exception, match="this group failed"):
            await Front.generate(Fake(), [(0, [1], SamplingParams(seed=1)),
                                          (1, [1], SamplingParams(seed=2))], receive)

    asyncio.run(call())
    deadline = time.time() + 20
    while not ray.get(Fake.coord.was_cancelled.remote()) and time.time() < deadline:
        time.sleep(0.1)
    assert ray.get(Fake.coord.was_cancelled.remote())
    ray.kill(Fake.coord)
