"""The HTTP front door under malformed and extreme input: every field of both endpoints driven
by hypothesis against one live server (default flags, an API key). Every answer is a 200 or
an OpenAI-style 4xx, and no worker ever sees a bad value (no worker group restart)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from raygraph.api.app import HttpConfig
from raygraph.api.server import start_http, stop_http
from tests.conftest import default_model_config

KEY = "fuzz-key"
MODEL = "default_model"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(default_model_coord):
    """HTTP servers of their own (default flags) in front of the session's shared coordinator
    of the built-in model."""
    cfg = default_model_config()
    _, url = start_http(HttpConfig(port=0, api_key=KEY), cfg.coordinator_name,
                        cfg.namespace)
    yield default_model_coord, url
    stop_http(cfg.coordinator_name, cfg.namespace)


def post(url: str, body: bytes, headers: dict[str, str] = AUTH) -> tuple[int, bytes]:
    req = urllib.request.Request(url, body, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def strict_json(text: bytes | str) -> object:
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check_answer(status: int, body: bytes) -> None:
    """A 200 (a response, or SSE events of valid JSON ending in [DONE]) or an OpenAI 4xx."""
    if status == 200:
        if body.startswith(b"data: "):
            events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e]
            assert events[-1] == b"[DONE]", body[-300:]
            for e in events[:-1]:
                assert "error" not in strict_json(e), e
        else:
            assert "choices" in strict_json(body)
        return
    assert 400 <= status < 500, (status, body[:500])
    err = strict_json(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]


def pick(*options: st.SearchStrategy) -> st.SearchStrategy:
    """One of `options`, each as likely (st.one_of flattens nested choices: a field's
    structured values would be lost among the many kinds of wrong ones)."""
    return st.integers(0, len(options) - 1).flatmap(lambda i: options[i])


EXTREME_INTS = [0, -1, 1, 2, 16, 17, 20, 21, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63,
                -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 2**70, -(2**70), 10**30]
ints = st.sampled_from(EXTREME_INTS) | st.integers(-10, 8)
floats = (st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e4,
                           1e4 + 1, 0.5, 2.0])
          | st.floats(allow_nan=True, allow_infinity=True))
wrong = (st.none() | st.booleans() | st.text(max_size=8) | st.just([]) | st.just({})
         | st.lists(ints, max_size=3) | st.just([[]]) | st.just({"a": [1, {"b": None}]}))
value = pick(ints, floats, wrong)
token_ids = st.lists(ints, min_size=0, max_size=6)
texts = st.text(max_size=8)

COMMON = {
    "model": pick(st.just(MODEL), texts, value),
    "max_tokens": pick(ints, value),
    "temperature": pick(floats, value),
    "top_p": pick(floats, value),
    "n": pick(ints, value),
    "stop": pick(texts, st.lists(texts, max_size=4), value),
    "seed": pick(ints, value),
    "user": pick(texts, value),
    "stream": pick(st.booleans(), value),
    "stream_options": pick(st.fixed_dictionaries({"include_usage": pick(st.booleans(),
                                                                          value)}), value),
    "top_k": pick(ints, value),
    "ignore_eos": pick(st.booleans(), value),
    "stop_token_ids": pick(token_ids, value),
}
COMPLETION = {
    **COMMON,
    "prompt": pick(st.text(max_size=20), token_ids, st.lists(token_ids, max_size=3),
                   st.lists(texts, max_size=3), value),
    "logprobs": pick(ints, value),
}
# messages are valid but for at most one leaf each, so a bad leaf deep inside is what the
# server meets (with several, the first wrong one answers for all)
part = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                      "content": pick(texts, st.lists(part, max_size=2))})
bad_message = pick(
    st.fixed_dictionaries({"role": value, "content": texts}),
    st.fixed_dictionaries({"role": st.just("user"), "content": value}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": value, "text": texts}), min_size=1, max_size=1)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": value}), min_size=1,
        max_size=1)}))
messages = st.lists(pick(good_message, bad_message), min_size=1, max_size=2)
CHAT = {
    **COMMON,
    "messages": pick(messages, value),
    "max_completion_tokens": pick(ints, value),
    "logprobs": pick(st.booleans(), value),
    "top_logprobs": pick(ints, value),
}
BASE = {
    "/v1/completions": {"model": MODEL, "prompt": "A class", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2, "max_completion_tokens": 2},
}


def bodies(fields: dict[str, st.SearchStrategy], base: dict) -> st.SearchStrategy[dict]:
    """The valid base with one to three of its endpoint's fields replaced by fuzz."""
    return st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3,
                    unique=True).flatmap(
        lambda names: st.fixed_dictionaries({k: fields[k] for k in names}).map(
            lambda fuzz: {**base, **fuzz}))


def answer_stays_safe(url: str, path: str, body: dict) -> None:
    status, out = post(url + path, json.dumps(body, allow_nan=True).encode())
    check_answer(status, out)


@settings(max_examples=70, deadline=None, derandomize=True)
@given(body=bodies(COMPLETION, BASE["/v1/completions"]))
def test_fuzzed_completions_get_200_or_an_openai_4xx(server, body):
    answer_stays_safe(server[1], "/v1/completions", body)


@settings(max_examples=70, deadline=None, derandomize=True)
@given(body=bodies(CHAT, BASE["/v1/chat/completions"]))
def test_fuzzed_chats_get_200_or_an_openai_4xx(server, body):
    answer_stays_safe(server[1], "/v1/chat/completions", body)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(messages=messages)
def test_fuzzed_chat_messages_get_200_or_an_openai_4xx(server, messages):
    """Messages alone (their structure is deep: one field among many rarely reaches it)."""
    answer_stays_safe(server[1], "/v1/chat/completions",
                      {**BASE["/v1/chat/completions"], "messages": messages})


@settings(max_examples=40, deadline=None, derandomize=True)
@given(path=st.sampled_from(sorted(BASE)),
       raw=st.binary(max_size=40) | st.sampled_from([b"", b"[]", b"null", b"1e999", b'"x"',
                                                     b"[" * 5000, b'{"prompt": NaN}',
                                                     b'{"prompt": [1e999]}',
                                                     b'{"prompt": ' + b"9" * 5000 + b"}"]))
def test_malformed_bodies_get_an_openai_400(server, path, raw):
    status, out = post(server[1] + path, raw)
    assert status == 400, (status, out[:300])
    check_answer(status, out)


def test_fuzzing_never_restarted_a_worker(ray_session, server):
    """After the fuzzers: nothing they sent reached a worker as a bad value."""
    coord, url = server
    stats = ray_session.get(coord.stats.remote())
    assert stats["restarts"] == 0 and stats["healthy"]
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        restarts = [s.value for f in text_string_to_metric_families(r.read().decode())
                    for s in f.samples if s.name == "raygraph:worker_restarts_total"]
    assert restarts == [0.0]
    status, _ = post(url + "/v1/completions", json.dumps(BASE["/v1/completions"]).encode())
    assert status == 200


def test_operator_routes_are_off_by_default(server):
    """Without --enable-sleep-routes and --enable-lora-updates they are 404s (401 without the
    key, which is checked first); /v1/models shows no server path."""
    url = server[1]
    for path in ("/sleep", "/wake_up", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        status, out = post(url + path, b'{"lora_name": "a", "lora_path": "/tmp"}')
        assert status == 404 and strict_json(out)["error"]["code"] == "not_found", path
        assert post(url + path, b"{}", {"Content-Type": "application/json"})[0] == 401
    req = urllib.request.Request(url + "/v1/models", headers=AUTH)
    with urllib.request.urlopen(req, timeout=30) as r:
        models = strict_json(r.read())["data"]
    assert [(m["id"], m["root"]) for m in models] == [(MODEL, MODEL)]
