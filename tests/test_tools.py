"""Tool calling's and reasoning's pieces without a server: Hermes-style blocks and <think>
parts split out of answers, whole and as a stream cut anywhere; the grammar that forces
calls (checked against llguidance's matcher with the default model's tokenizer); the tools
and tool messages as the default template renders them; the request fields' checks."""

from __future__ import annotations

import json
import random

import jsonschema
import pydantic
import pytest

from raygraph.api.answers import AnswerStream, after_reasoning, answer
from raygraph.api.schemas import ChatRequest
from raygraph.api.tools import TOOL_FORMATS, ToolCalls, format_for
from raygraph.config import DEFAULT_MODEL
from raygraph.grammar import Grammars
from raygraph.protocol import GenerateResult, StructuredOutputs
from raygraph.tokenizer import load_tokenizer

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
ANSWER = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


HERMES = TOOL_FORMATS["hermes"]
NAMES = frozenset({"get_weather", "get_time"})


def offered(fmt: str | None) -> ToolCalls | None:
    return ToolCalls(TOOL_FORMATS[fmt], NAMES) if fmt else None


def whole(text: str, reasoning: str | None = None, tools: str | None = "hermes",
          finish: str = "stop") -> dict:
    return answer(GenerateResult(0, [], [], text, finish), reasoning, offered(tools))


def streamed(text: str, rng: random.Random, reasoning: str | None = None,
             tools: str | None = "hermes") -> tuple[list[dict], AnswerStream]:
    """`text` fed in random pieces: the deltas, and the splitter."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
    stream, deltas = AnswerStream(reasoning, offered(tools)), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[a:b])
    return deltas + stream.finish(), stream


def test_calls_are_parsed_out_of_the_text():
    out = whole(ANSWER)
    msg = out["message"]
    assert msg["content"] == "Let me check. "  # the newline between two calls is neither
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_")
               for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == 2 and out["finish_reason"] == "tool_calls"
    assert whole(ANSWER, finish="length")["finish_reason"] == "length"  # calls kept
    for text in ["plain <tool_ text", "<tool_call>\nnot json\n</tool_call> then",
                 '<tool_call>\n{"name": "f"',  # not a call: left as the model wrote it
                 '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # no such tool
                 '<tool_call>\n{"name": ["get_time"], "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_time", "arguments": 1e999}\n</tool_call>']:
        out = whole(text)
        assert out["message"] == {"role": "assistant", "content": text}
        assert out["finish_reason"] == "stop"


@pytest.mark.parametrize("seed", range(20))
def test_a_stream_cut_anywhere_gives_the_same_content_and_calls(seed):
    """Content deltas never show a piece of a call block; call deltas carry whole calls."""
    deltas, stream = streamed(ANSWER, random.Random(seed))
    text = "".join(d.get("content", "") for d in deltas)
    assert text == "Let me check. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and stream.calls == 2
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


REASONED = [  # (parser, answer, reasoning_content, content)
    ("deepseek_r1", "The user wants x.</think>\n\nIt is x.", "The user wants x.", "It is x."),
    ("deepseek_r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "Still thinking when the limit came", "Still thinking when the limit came",
     ""),
    ("qwen3", "<think>\nShort.\n</think>\n\nDone.", "\nShort.\n", "Done."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<thin", None, "<thin"),
]


@pytest.mark.parametrize("parser,text,reasoning,content", REASONED)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(parser, text, reasoning,
                                                              content):
    msg = whole(text, parser, tools=None)["message"]
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
    for seed in range(10):
        deltas, _ = streamed(text, random.Random(seed), parser, tools=None)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
        assert "".join(d.get("content", "") for d in deltas) == content


def test_reasoning_then_a_tool_call():
    text = "<think>Weather needs a call.</think>\n" + ANSWER
    msg = whole(text, "qwen3")["message"]
    assert msg["reasoning_content"] == "Weather needs a call."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    deltas, stream = streamed(text, random.Random(3), "qwen3")
    assert stream.calls == 2 and "<" not in "".join(d.get("content", "") for d in deltas)


@pytest.fixture(scope="module")
def grammars():
    return Grammars(load_tokenizer(DEFAULT_MODEL).hf)


def matches(grammars: Grammars, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (tokenized as the model would write it)."""
    m = grammars.guide(StructuredOutputs("grammar", grammar)).matcher
    ok = all(m.consume_token(t) for t in grammars.tokenizer.tokenize_str(text))
    return ok and not m.is_error() and m.is_accepting()


def test_the_forcing_grammar_takes_valid_calls_only(grammars):
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    both, named = HERMES.grammar([WEATHER, TIME], True), HERMES.grammar([WEATHER], False)
    assert matches(grammars, both, one) and matches(grammars, both, two)
    assert matches(grammars, named, one) and not matches(grammars, named, two)
    for bad in ['<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                '"x": 1}}\n</tool_call>', "plain text"]:
        assert not matches(grammars, both, bad), bad
    msg = whole(two)["message"]
    assert msg["content"] is None
    jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]),
                        WEATHER["parameters"])


def request(**kw) -> ChatRequest:
    tools = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                       "tools": tools, **kw})


def test_tool_choice_picks_the_functions_a_call_must_be_of():
    assert request().forced_tools() is None and request().tools_active
    assert request(tool_choice="none").forced_tools() is None
    assert not request(tool_choice="none").tools_active
    assert [f["name"] for f in request(tool_choice="required").forced_tools()] == [
        "get_weather", "get_time"]
    named = request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [f["name"] for f in named.forced_tools()] == ["get_time"]
    for bad, words in [({"tool_choice": {"type": "function", "function": {"name": "x"}}},
                        "no tool named 'x'"),
                       ({"tool_choice": "required", "response_format": {"type": "json_object"}},
                        "one output constraint")]:
        with pytest.raises(pydantic.ValidationError, match=words):
            request(**bad)
    with pytest.raises(pydantic.ValidationError, match="no tools given"):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                    "tool_choice": "required"})


LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
         '{"name": "get_time", "parameters": {}}')
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
          '{"name": "get_time", "arguments": {}}]'


@pytest.mark.parametrize("fmt,text", [("llama3_json", LLAMA), ("llama3_json", LLAMA[14:]),
                                      ("mistral", MISTRAL), ("mistral", MISTRAL[12:])])
def test_llama3_and_mistral_calls_whole_streamed_and_forced(grammars, fmt, text):
    """An answer that opens as calls is all calls (the marker may have been a special token,
    dropped from the text); other answers are content, streamed as they come; the forcing
    grammar writes what the parser reads."""
    msg = whole(text, tools=fmt)["message"]
    assert msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for seed in range(5):
        deltas, stream = streamed(text, random.Random(seed), tools=fmt)
        assert stream.calls == 2 and not any("content" in d for d in deltas)
    stranger = '{"name": "Bob", "age": 3}' if fmt == "llama3_json" else '[{"name": "Bob"}]'
    assert whole(stranger, tools=fmt)["message"]["content"] == stranger  # JSON, not a call
    prose = "The weather is fine [1]."
    assert whole(prose, tools=fmt)["message"] == {"role": "assistant", "content": prose}
    deltas, _ = streamed(prose, random.Random(0), tools=fmt)
    assert "".join(d["content"] for d in deltas) == prose
    grammar = TOOL_FORMATS[fmt].grammar([WEATHER, TIME], True)
    forced = text.removeprefix("<|python_tag|>").removeprefix("[TOOL_CALLS]")
    assert matches(grammars, grammar, forced)
    assert not matches(grammars, TOOL_FORMATS[fmt].grammar([TIME], False), forced)


def test_the_format_is_read_off_the_chat_template():
    assert format_for(None, "{{ '<tool_call>' }}").name == "hermes"
    assert format_for(None, "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_for(None, "{% if role == 'ipython' %}").name == "llama3_json"
    assert format_for(None, None).name == "hermes"
    assert format_for("mistral", "{{ '<tool_call>' }}").name == "mistral"


@pytest.mark.parametrize("spec,answer", [
    ({"kind": "json", "value": json.dumps({"type": "object", "properties": {"a": {
        "type": "integer"}}, "required": ["a"]})}, '{"a": 5}'),
    ({"kind": "regex", "value": "[0-9]+/[0-9]+"}, "12/34"),
    ({"kind": "choice", "value": json.dumps(["yes", "no"])}, "no"),
    ({"kind": "grammar", "value": HERMES.grammar([TIME], False)},
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')])
def test_a_format_constrains_the_answer_after_the_reasoning(grammars, spec, answer):
    """With a reasoning parser the thinking is free and the format applies after </think>
    (deepseek_r1: reasoning always comes first; qwen3: only when the answer opens with
    <think>)."""
    thought = "<think>Hmm, {not json} and </b> tags.</think>\n\n"
    lark = spec["kind"] == "grammar"
    r1 = after_reasoning(spec, "deepseek_r1", lark)["value"]
    q3 = after_reasoning(spec, "qwen3", lark)["value"]
    assert matches(grammars, r1, thought + answer)
    assert matches(grammars, r1, thought[len("<think>"):] + answer)
    assert not matches(grammars, r1, answer) and not matches(grammars, r1, thought + "x")
    assert matches(grammars, q3, thought + answer) and matches(grammars, q3, answer)
    assert not matches(grammars, q3, "Hmm." + answer)
    slash = after_reasoning({"kind": "regex", "value": "[0-9]+\\/[0-9]+"}, "qwen3")["value"]
    assert matches(grammars, slash, "12/34")  # an escaped slash stays one
    own = {"kind": "grammar", "value": 'root ::= "a"'}  # a client's grammar: the whole answer
    assert after_reasoning(own, "qwen3") == own and after_reasoning(spec, None) == spec


def test_the_default_template_renders_tools_calls_and_results():
    tok = load_tokenizer(DEFAULT_MODEL).hf
    msgs = request(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]).messages
    tools = [{"type": "function", "function": WEATHER}]
    text = tok.apply_chat_template([m.text() for m in msgs], tools=tools,
                                   add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text  # the arguments rendered as an object, not a quoted string
    assert text.endswith('<tool_response>\n{"temp": 3}\n</tool_response>\nassistant:')
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                    add_generation_prompt=True, tokenize=False)
    assert plain == "<|bos|>user: Hi\nassistant:"
