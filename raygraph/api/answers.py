"""A chat answer's text split into OpenAI's parts (HTTP front): the reasoning a reasoning
model writes inside `<think>...</think>` (`--reasoning-parser`) as `reasoning_content`, the
rest as `content`, and tool-call blocks in it as `tool_calls` (raygraph/api/tools.py). The
same splitter serves whole answers and streams, so both give the same parts."""

from __future__ import annotations

import json
import re
from typing import Any

from raygraph.api.schemas import finish_reason
from raygraph.api.tools import CallStream, ToolCalls, partial_suffix
from raygraph.grammar import fixed_whitespace
from raygraph.protocol import GenerateResult, StreamDelta

THINK, END_THINK = "<think>", "</think>"
# deepseek_r1: the answer starts inside the reasoning (its template opens <think> in the
# prompt; a leading <think> is dropped); qwen3: only an answer that opens with <think> has
# reasoning (thinking can be switched off)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def after_reasoning(spec: dict[str, str] | None, parser: str | None, lark: bool = False
                    ) -> dict[str, str] | None:
    """The grammar of a reasoning model's whole answer: free reasoning up to </think>
    (deepseek_r1: always; qwen3: when the answer opens with <think>), then `spec`'s, so the
    format constrains the answer and not the thinking. `lark`: spec is a grammar raygraph
    built (a forced tool call); a client's own grammar constrains the whole answer."""
    if spec is None or parser is None:
        return spec
    kind, value = spec["kind"], spec["value"]
    try:
        if kind == "json":
            answer = f"answer: %json {fixed_whitespace(value)}"
        elif kind == "regex":
            answer = "answer: /" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", value) + "/"
        elif kind == "choice":
            answer = "answer: " + " | ".join(json.dumps(c) for c in json.loads(value))
        elif lark:
            answer = value.replace("start:", "answer:", 1)
        else:
            return spec
    except (ValueError, TypeError):
        return spec  # not valid: its own compile says why
    head = "start: reasoning /\\n*/ answer" if parser == "deepseek_r1" else \
        'start: ("<think>" reasoning /\\n*/)? answer'
    return {"kind": "grammar",
            "value": f"{head}\nreasoning[lazy]: /(.|\\n)*<\\/think>/\n{answer}\n"}


class ReasoningSplit:
    """Text as it streams -> ("reasoning" | "content", text) pieces."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"  # start (nothing decided), reasoning, content
        self._held = ""
        self._strip = False  # the answer after </think> has not started yet

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self._held.lstrip()
            if THINK.startswith(head):
                return out  # may still open with <think>: wait
            if head.startswith(THINK):
                self._held, self.state = head[len(THINK):], "reasoning"
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            end = self._held.find(END_THINK)
            if end < 0:
                keep = partial_suffix(self._held, END_THINK)
                cut = len(self._held) - keep
                if cut:
                    out.append(("reasoning", self._held[:cut]))
                self._held = self._held[cut:]
                return out
            if end:
                out.append(("reasoning", self._held[:end]))
            self._held, self.state = self._held[end + len(END_THINK):], "content"
            self._strip = True
        if self._strip:  # the newlines between </think> and the answer are neither
            self._held = self._held.lstrip("\n")
            self._strip = not self._held
        if self._held:
            out.append(("content", self._held))
        self._held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self.state == "reasoning" else "content", held)]


class AnswerStream:
    """One chat choice's text -> OpenAI delta dicts ({"reasoning_content"}, {"content"},
    {"tool_calls"}), in order; nothing is split when neither option is on."""

    def __init__(self, reasoning: str | None, tools: ToolCalls | None) -> None:
        self.reasoning = ReasoningSplit(reasoning) if reasoning else None
        self.tools = CallStream(tools) if tools else None

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools else 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        parts = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        return self._deltas(parts, False)

    def finish(self) -> list[dict[str, Any]]:
        parts = self.reasoning.finish() if self.reasoning else []
        return self._deltas(parts, True)

    def _deltas(self, parts: list[tuple[str, str]], last: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self.tools is not None:
                out += self.tools.feed(text)
            elif text:
                out.append({"content": text})
        if last and self.tools is not None:
            out += self.tools.finish()
        return out


def answer(r: GenerateResult, reasoning: str | None, tools: ToolCalls | None
           ) -> dict[str, Any]:
    """A whole chat choice: its message (content, reasoning_content, tool_calls) and ending
    (finish_reason "tool_calls" when calls closed before any limit)."""
    stream = AnswerStream(reasoning, tools)
    deltas = stream.feed(r.text or "") + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = "".join(d.get("reasoning_content", "")
                                               for d in deltas) or None
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    end = ending(r)
    if calls:
        message["content"] = content if content.strip() else None
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        if r.finish_reason != "length":
            end = {"finish_reason": "tool_calls", "stop_reason": None}
    return {"message": message, **end}


def chat_chunks(i: int, d: StreamDelta, logprobs: dict | None,
                stream: AnswerStream | None) -> list[dict[str, Any]]:
    """One stream delta's chat chunks: its text, or the parts it completes (none while a
    call or a possible tag is held back); logprobs ride on the first chunk, the ending on
    the last."""
    if stream is None:
        return [{"index": i, "delta": {"content": d.text} if d.text else {},
                 "logprobs": logprobs, **ending(d)}]
    pieces = stream.feed(d.text or "") + (stream.finish() if d.finish_reason is not None
                                           else [])
    if not pieces and logprobs is None and d.finish_reason is None:
        return []
    out = [{"index": i, "delta": p, "logprobs": None, "finish_reason": None,
            "stop_reason": None} for p in pieces or [{}]]
    out[0]["logprobs"] = logprobs
    if d.finish_reason is not None:
        out[-1].update(ending(d))
        if stream.calls and d.finish_reason != "length":
            out[-1].update(finish_reason="tool_calls", stop_reason=None)
    return out


def ending(r: GenerateResult | StreamDelta) -> dict[str, Any]:
    """A choice's finish_reason and stop_reason (the stop string or token id; None for EOS
    and until the last chunk of a stream)."""
    return {"finish_reason": finish_reason(r.finish_reason), "stop_reason": r.stop_reason}
