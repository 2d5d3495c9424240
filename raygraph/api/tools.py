"""Tool calling on the chat route (HTTP front): the chat template renders the tools, the
model answers in its family's call format, and the calls become OpenAI's `tool_calls`,
whole or as stream deltas. `tool_choice` "required" or a named function is enforced by a
grammar of that format built from the tools' parameter schemas, so the calls always parse
and their arguments match the schemas.

Formats (`--tool-call-parser`, else read off the chat template):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks among the
  text (Qwen2.5, Qwen3, Hermes);
- llama3_json: the answer is `{"name": ..., "parameters": {...}}`, calls separated by "; ",
  after an optional `<|python_tag|>` (Llama 3.1-3.3);
- mistral: the answer is `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` (the
  marker is a special token, so the text may start at the list).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the JSON inside a forced call: the separators the parsers and the templates expect
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # the arguments' key in a call's JSON
    starts: tuple[str, ...]  # llama3_json, mistral: an answer that opens so is all calls

    def call_schema(self, function: dict[str, Any]) -> dict[str, Any]:
        """The JSON of one call of `function` ({"name", "parameters"}, OpenAI's shape)."""
        return {"type": "object", "properties": {
            "name": {"const": function["name"]},
            self.args_key: function.get("parameters") or {"type": "object"}},
            "required": ["name", self.args_key], "additionalProperties": False}

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) of one call, or several, of the given functions:
        what `required` or a named tool_choice lets the model write."""
        one = {"anyOf": [self.call_schema(f) for f in functions]}
        if self.name == "mistral":
            calls = {"type": "array", "items": one, "minItems": 1, "x-guidance": JSON_STYLE}
            if not parallel:
                calls["maxItems"] = 1
            return f"start: %json {json.dumps(calls)}\n"
        body = f"body: %json {json.dumps({**one, 'x-guidance': JSON_STYLE})}\n"
        if self.name == "llama3_json":
            more = ' ("; " body)*' if parallel else ""
            return f"start: body{more}\n" + body
        more = ' ("\\n" call)*' if parallel else ""
        return f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\n' + body

    def parse_rest(self, text: str, names: frozenset[str]) -> list[dict[str, Any]] | None:
        """The calls an answer opening with one of `starts` holds, or None if it does not
        parse (then it is content, as the model wrote it)."""
        text = text.strip()
        for marker in ("<|python_tag|>", "[TOOL_CALLS]"):
            text = text.removeprefix(marker).lstrip()
        docs: list[Any] = []
        decoder, i = json.JSONDecoder(), 0
        try:
            while i < len(text):
                doc, i = decoder.raw_decode(text, i)
                docs += doc if isinstance(doc, list) else [doc]
                while i < len(text) and text[i] in "; \n":
                    i += 1
        except (ValueError, RecursionError):
            return None
        calls = [to_call(d, names) for d in docs]
        return calls if calls and all(c is not None for c in calls) else None


@dataclass(frozen=True)
class ToolCalls:
    """What a chat answer's calls are parsed against: the model's format and the names of
    the tools the request offered (JSON naming anything else is content)."""

    fmt: ToolFormat
    names: frozenset[str]


TOOL_FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", ()),
    "llama3_json": ToolFormat("llama3_json", "parameters", ("<|python_tag|>", "{")),
    "mistral": ToolFormat("mistral", "arguments", ("[TOOL_CALLS]", "[")),
}


def format_for(name: str | None, template: str | None) -> ToolFormat:
    """The format `--tool-call-parser` names, else the one the chat template writes."""
    if name is None:
        t = template or ""
        name = "hermes" if OPEN in t else "mistral" if "[TOOL_CALLS]" in t else \
            "llama3_json" if "<|python_tag|>" in t or "ipython" in t else "hermes"
    return TOOL_FORMATS[name]


def to_call(doc: Any, names: frozenset[str]) -> dict[str, Any] | None:
    """A call's JSON (text or parsed) as an OpenAI tool call, or None when it is not a call
    of one of `names`."""
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError):
            return None
    if not (isinstance(doc, dict) and isinstance(doc.get("name"), str)
            and doc["name"] in names):
        return None
    try:  # arguments as JSON; a number past float's range (1e999) is not a call's
        args = json.dumps(doc.get("arguments", doc.get("parameters", {})), allow_nan=False)
    except ValueError:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": doc["name"], "arguments": args}}


class CallStream:
    """Splits an answer's text, as it streams, into content deltas and tool-call deltas.
    Hermes: text that may start a call block is held back until it is known not to; a
    block goes out as one delta (id, name and all its arguments) when it closes. The other
    formats: an answer that opens as a call is held to its end, then sent as calls."""

    def __init__(self, tools: ToolCalls) -> None:
        self.fmt, self.names = tools.fmt, tools.names
        fmt = self.fmt
        self.calls = 0
        self._held = ""  # text not sent yet: a possible opening, or an open call
        self._mode = "start" if fmt.starts else "blocks"  # start, rest (all calls), blocks

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes (OpenAI's delta dicts, in order)."""
        self._held += text
        if self._mode == "start":
            head = self._held.lstrip()
            if not head or any(m.startswith(head) for m in self.fmt.starts):
                return []  # may still open as a call
            self._mode = "rest" if head.startswith(self.fmt.starts) else "text"
        if self._mode == "rest":
            return []  # parsed whole at the end
        if self._mode == "text":
            held, self._held = self._held, ""
            return [{"content": held}]
        return self._blocks()

    def _blocks(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self._held:
            start = self._held.find(OPEN)
            if start < 0:
                keep = partial_suffix(self._held, OPEN)
                if self.calls and not self._held[: len(self._held) - keep].strip():
                    break  # whitespace after a call: a separator, unless text follows
                if len(self._held) > keep:
                    out.append({"content": self._held[: len(self._held) - keep]})
                    self._held = self._held[len(self._held) - keep:]
                break
            if start:
                text = self._held[:start]
                if not (self.calls and not text.strip()):  # not the separator of two calls
                    out.append({"content": text})
                self._held = self._held[start:]
            end = self._held.find(CLOSE)
            if end < 0:
                break  # inside a block: wait for its end
            block, self._held = self._held[len(OPEN): end], self._held[end + len(CLOSE):]
            call = to_call(block.strip(), self.names)
            out.append({"content": OPEN + block + CLOSE} if call is None else
                       self._call(call))
        return out

    def _call(self, call: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, **call}]}

    def finish(self) -> list[dict[str, Any]]:
        """What is still held when the answer ends: an answer that opened as calls, parsed
        (content if it does not parse); an unclosed block is content."""
        held, self._held = self._held, ""
        if self._mode == "rest":
            calls = self.fmt.parse_rest(held, self.names)
            if calls is not None:
                return [self._call(c) for c in calls]
        if self.calls and not held.strip():
            return []  # the whitespace after the last call
        return [{"content": held}] if held else []


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message for the chat template: an assistant's tool calls with their arguments as
    objects (templates write them with `tojson`; OpenAI sends them as JSON text)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        f = dict(c.get("function") or {})
        if isinstance(f.get("arguments"), str):
            try:
                f["arguments"] = json.loads(f["arguments"])
            except (ValueError, RecursionError):
                pass  # the template writes it as it came
        out.append({**c, "function": f})
    return {**m, "tool_calls": out}
