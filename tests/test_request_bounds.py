"""Whatever a request may carry, it is refused where it enters or the workers accept it:
every sampling field that passes `parse_params` survives the step messages (msgpack) and
the sampler's rows, so no value of one request can fail a step for the others."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raygraph.errors import BadRequest
from raygraph.protocol import INT64_MAX, INT64_MIN, NewSeq, SeqChunk, nth_seed
from raygraph.requests import parse_params
from raygraph.worker.sampler import SamplingRows

ints = st.one_of(st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
                 st.sampled_from([0, -1, 1, INT64_MAX, INT64_MIN, INT64_MAX + 1, 2**64 - 1,
                                  2**64, -(2**63) - 1, 2**31 - 1, 2**31]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-45, 1e4, 1e4 + 1, 3.5e38, 1e300]))
anything = st.one_of(ints, floats, st.none(), st.text(max_size=4), st.booleans(),
                     st.lists(ints, max_size=3))
fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(ints, anything), "temperature": st.one_of(floats, anything),
    "top_k": st.one_of(ints, anything), "top_p": st.one_of(floats, anything),
    "seed": st.one_of(ints, anything), "stop_token_ids": st.lists(ints, max_size=3),
    "logprobs": st.one_of(ints, anything), "stop": st.one_of(st.lists(st.text(max_size=3),
                                                                       max_size=2), anything),
    "ignore_eos": anything})
ENCODE = msgspec.msgpack.Encoder().encode


@settings(max_examples=400, deadline=None)
@given(fields, st.integers(min_value=1, max_value=16))
def test_accepted_params_reach_the_workers_intact(params, n):
    try:
        sp = parse_params(params).resolved()
    except BadRequest:
        return
    seeds = [None if sp.seed is None else nth_seed(sp.seed, i) for i in range(n)]
    for seed in seeds:  # what the scheduler and the step message carry
        new = NewSeq(1, sp.temperature, sp.top_k, sp.top_p, seed)
        assert msgspec.msgpack.decode(ENCODE(new), type=NewSeq) == new
        chunk = SeqChunk(1, [1], 0, [0], True, sp.temperature, sp.top_k, sp.top_p, seed)
        rows = SamplingRows(1, torch.device("cpu"))
        _, temp, top_k, top_p = rows.upload([chunk], [0])
        assert math.isfinite(temp.item()) and top_k.item() >= 0 and 0 < top_p.item() <= 1
    assert all(ENCODE(s) for s in sp.stop_token_ids)


def test_nth_seed_wraps_into_int64_and_keeps_samples_apart():
    assert nth_seed(INT64_MAX, 1) == INT64_MIN
    assert [nth_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert len({nth_seed(INT64_MAX - 1, i) for i in range(16)}) == 16


@pytest.mark.parametrize("field,value", [("seed", 2**63), ("seed", -(2**63) - 1),
                                         ("top_k", 2**64), ("max_tokens", 2**40),
                                         ("temperature", float("inf")),
                                         ("temperature", float("nan")),
                                         ("top_p", float("nan")), ("stop_token_ids", [-1])])
def test_values_past_the_workers_bounds_are_bad_requests(field, value):
    with pytest.raises(BadRequest, match=field):
        parse_params({field: value})


def test_a_completion_asks_for_at_most_max_choices():
    """Prompts x n past MAX_SEQUENCES is a 400 before any prompt is read; one prompt of many
    token ids is one prompt."""
    import pydantic

    from raygraph.api.schemas import MAX_SEQUENCES, CompletionRequest

    CompletionRequest(prompt=[[1]] * (MAX_SEQUENCES // 16), n=16)
    CompletionRequest(prompt=list(range(5000)))
    for body in ({"prompt": [[1]] * (MAX_SEQUENCES + 1)}, {"prompt": ["a"] * (MAX_SEQUENCES + 1)},
                 {"prompt": [[1]] * (MAX_SEQUENCES // 16 + 1), "n": 16}):
        with pytest.raises(pydantic.ValidationError, match=f"at most {MAX_SEQUENCES}"):
            CompletionRequest(**body)


def test_lists_of_millions_of_items_are_refused_before_they_are_read():
    """Token ids (one prompt or many), messages, Responses input items and tools past their
    caps are 400s counted before any item is validated (validating millions of them took
    pydantic seconds on the HTTP actor's event loop): a list whose items are also bad gets
    the count as its only error. A bad token id is still named."""
    import pydantic

    from raygraph.api.responses import ResponsesRequest
    from raygraph.api.schemas import (
        MAX_MESSAGES,
        MAX_PROMPT_TOKENS,
        ChatRequest,
        CompletionRequest,
    )

    CompletionRequest(prompt=[7] * MAX_PROMPT_TOKENS)
    message, bad = {"role": "user", "content": ""}, {"role": 5}
    ChatRequest(messages=[message] * MAX_MESSAGES)
    for make, body in (
            (CompletionRequest, {"prompt": [-1] * (MAX_PROMPT_TOKENS + 1)}),
            (CompletionRequest, {"prompt": [[-1] * (MAX_PROMPT_TOKENS // 2 + 1)] * 2}),
            (ChatRequest, {"messages": [bad] * (MAX_MESSAGES + 1)}),
            (ChatRequest, {"messages": [message], "tools": [bad] * (MAX_MESSAGES + 1)}),
            (ResponsesRequest, {"input": [5] * (MAX_MESSAGES + 1)})):
        with pytest.raises(pydantic.ValidationError) as e:
            make(**body)
        assert len(e.value.errors()) == 1 and "at most" in str(e.value), e.value
    with pytest.raises(pydantic.ValidationError, match="token id -3 is not in"):
        CompletionRequest(prompt=[1, 2, -3, 4])
    # content parts and tool calls count with their messages: one message of many parts
    parts = {"role": "user", "content": [{"type": "text", "text": ""}] * MAX_MESSAGES}
    with pytest.raises(pydantic.ValidationError, match=f"at most {MAX_MESSAGES} items"):
        ChatRequest(messages=[parts])
    with pytest.raises(pydantic.ValidationError, match=f"at most {MAX_MESSAGES} items"):
        ResponsesRequest(input=[parts])
    # instructions make one more message: the 400 names what the client sent
    with pytest.raises(pydantic.ValidationError, match="input: at most"):
        ResponsesRequest(input=[message] * MAX_MESSAGES, instructions="be brief")
    with pytest.raises(pydantic.ValidationError, match="at most 1024 prompts"):
        CompletionRequest(prompt=["a"] * (MAX_PROMPT_TOKENS + 1))


def test_echoed_responses_fields_and_text_parts_are_checked_before_running():
    """A Responses field echoed back (metadata, text, tools, tool_choice) with NaN, and a
    text part that is not text, are 400s, not failures after the answer is computed."""
    import pydantic

    from raygraph.api.responses import ResponsesRequest

    ResponsesRequest(input="hi", metadata={"a": 1.5})
    deep: dict = {}
    for _ in range(990):  # parses (pydantic), past what json.dumps then recurses through
        deep = {"a": deep}
    for body in ({"input": "hi", "metadata": {"a": math.nan}},
                 {"input": "hi", "metadata": {"k": "\ud800"}},  # a lone surrogate
                 {"input": "hi", "metadata": deep},
                 {"input": "hi", "text": {"format": {"type": "text"}, "x": math.inf}},
                 {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}):
        with pytest.raises(pydantic.ValidationError):
            ResponsesRequest(**body)


def test_text_with_a_lone_surrogate_is_a_bad_request():
    from raygraph.config import DEFAULT_MODEL
    from raygraph.tokenizer import load_tokenizer

    tok = load_tokenizer(str(DEFAULT_MODEL))
    assert tok.encode("caf\u00e9") == tok.hf("caf\u00e9")["input_ids"]
    with pytest.raises(BadRequest, match="not valid Unicode"):
        tok.encode("a\ud800b")


def test_a_choice_list_past_max_choices_is_refused():
    import json

    from raygraph.config import DEFAULT_MODEL
    from raygraph.grammar import MAX_CHOICES, Grammars
    from raygraph.protocol import StructuredOutputs
    from raygraph.tokenizer import load_tokenizer

    grammars = Grammars(load_tokenizer(str(DEFAULT_MODEL)).hf)
    grammars.compile(StructuredOutputs("choice", json.dumps(["yes", "no"])))
    many = json.dumps([f"option_{i}" for i in range(MAX_CHOICES + 1)])
    with pytest.raises(BadRequest, match=f"at most {MAX_CHOICES} choices"):
        grammars.compile(StructuredOutputs("choice", many))


@pytest.mark.parametrize("field,neutral,asked", [
    ("presence_penalty", 0.0, 0.5), ("frequency_penalty", 0, -1.0),
    ("repetition_penalty", 1.0, 1.2), ("min_tokens", 0, 4), ("echo", False, True),
    ("best_of", 1, 3), ("suffix", "", "x")])
def test_fields_not_built_are_refused_unless_neutral(field, neutral, asked):
    """A penalty or other OpenAI/vLLM field the sampler does not apply is a 400 naming it,
    never silently ignored; its neutral value passes."""
    import pydantic

    from raygraph.api.schemas import ChatRequest, CompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    CompletionRequest(prompt="x", **{field: neutral})
    ChatRequest(messages=messages, **{field: neutral})
    for make in (lambda: CompletionRequest(prompt="x", **{field: asked}),
                 lambda: ChatRequest(messages=messages, **{field: asked})):
        with pytest.raises(pydantic.ValidationError, match=field):
            make()


def test_an_empty_stop_string_is_a_bad_request():
    assert parse_params({"stop": ["a", "bc"]}).stop == ["a", "bc"]
    with pytest.raises(BadRequest, match="stop"):
        parse_params({"stop": [""]})


def test_stop_strings_are_bounded_in_number_and_length():
    """Each new token is checked against every stop string on the engine's event loop,
    which serves the whole replica: a request may give at most MAX_STOP_STRINGS of at most
    MAX_STOP_CHARS, on the HTTP front and the Python API alike."""
    import pydantic

    from raygraph.api.schemas import CompletionRequest
    from raygraph.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

    most = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert parse_params({"stop": most}).stop == most
    CompletionRequest(prompt="x", stop=most)
    CompletionRequest(prompt="x", stop="a" * MAX_STOP_CHARS)
    for stop in ([*most, "one more"], ["a" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(BadRequest, match="stop"):
            parse_params({"stop": stop})
        with pytest.raises(pydantic.ValidationError, match="stop"):
            CompletionRequest(prompt="x", stop=stop)
    with pytest.raises(pydantic.ValidationError, match="stop"):
        CompletionRequest(prompt="x", stop="a" * (MAX_STOP_CHARS + 1))


def test_a_prompt_that_is_neither_text_nor_ids_is_a_bad_request():
    from raygraph.requests import split_prompts

    assert split_prompts(["a", [1, 2]]) == ["a", [1, 2]]
    with pytest.raises(BadRequest, match="got NoneType"):
        split_prompts(["a", None])


def test_a_chat_message_needs_content_unless_an_assistant_calls():
    import pydantic

    from raygraph.api.schemas import ChatMessage

    ChatMessage(role="assistant", tool_calls=[{"function": {"name": "f"}}])
    with pytest.raises(pydantic.ValidationError, match="a user message needs content"):
        ChatMessage(role="user")


def test_validation_messages_name_the_problem():
    """A negative token id is named as such (not as the union's first branch, a string);
    a Responses error nested in its chat request carries no pydantic prefix."""
    import pydantic

    from raygraph.api.responses import ResponsesRequest
    from raygraph.api.schemas import CompletionRequest

    with pytest.raises(pydantic.ValidationError, match=r"token id -1 is not in \[0, "):
        CompletionRequest(prompt=[5, -1])
    with pytest.raises(pydantic.ValidationError) as e:
        ResponsesRequest(input="hi", text={"format": {"type": "json_schema"}})
    assert "Value error, " not in str(e.value).replace("Value error, ", "", 1)


def test_json_text_nested_past_pythons_stack_is_refused_or_plain_text():
    """JSON given as text and nested past Python's recursion limit is a schema llguidance
    refuses (a 400), an assistant's arguments passed to the template as written, and a
    model's output not a tool call: never a RecursionError (a 500)."""
    import pydantic

    from raygraph.api.schemas import CompletionRequest
    from raygraph.api.tools import template_message, to_call
    from raygraph.grammar import fixed_whitespace

    deep = "[" * 50_000 + "]" * 50_000
    assert fixed_whitespace(deep) == deep
    args = '{"a": ' + deep + "}"
    m = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": args}}]}
    assert template_message(m)["tool_calls"][0]["function"]["arguments"] == args
    assert to_call('{"name": "f", "arguments": ' + deep + "}", frozenset({"f"})) is None
    schema: dict = {}
    for _ in range(990):
        schema = {"not": schema}
    with pytest.raises(pydantic.ValidationError, match="nested too deeply"):
        CompletionRequest(prompt="x", response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def test_a_temperature_below_the_floor_samples_greedily():
    """logits / 1e-38 overflow float32: such a request (or model default) samples
    greedily, as vLLM does, instead of drawing token 0 from NaN rows every step."""
    from raygraph.protocol import MIN_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=1e-38).resolved().temperature == 0.0
    assert SamplingParams().resolved({"temperature": 1e-30}).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).resolved().temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.7).resolved().temperature == 0.7
