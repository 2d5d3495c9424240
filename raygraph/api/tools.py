"""Tool calling on the chat route (HTTP front): the chat template renders the tools, the
model answers with Hermes-style blocks (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, as Qwen2.5, Qwen3 and Hermes models write them), and those blocks become
OpenAI's `tool_calls`, whole or as stream deltas. `tool_choice` "required" or a named
function is enforced by a grammar built from the tools' parameter schemas, so the calls
always parse and their arguments match the schemas."""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the JSON inside a forced call: the separators the parser and the templates expect
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one call of `function` ({"name", "parameters"}, OpenAI's shape)."""
    return {"type": "object", "properties": {
        "name": {"const": function["name"]},
        "arguments": function.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance) of one call, or several separated by newlines, of the
    given functions: what `required` or a named tool_choice lets the model write."""
    schema = {"anyOf": [call_schema(f) for f in functions], "x-guidance": JSON_STYLE}
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")


def to_call(block: str) -> dict[str, Any] | None:
    """One block's JSON as an OpenAI tool call, or None when it is not a call."""
    try:
        doc = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(doc, dict) and isinstance(doc.get("name"), str)):
        return None
    args = doc.get("arguments", doc.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": doc["name"], "arguments": json.dumps(args)}}


class CallStream:
    """Splits an answer's text, as it streams, into content deltas and tool-call deltas.
    Text that may be the start of a call block is held back until it is known not to be;
    a block goes out as one delta (id, name and all its arguments) when it closes."""

    def __init__(self) -> None:
        self.calls = 0
        self._held = ""  # text not sent yet: a possible OPEN prefix, or an open block

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes (OpenAI's delta dicts, in order)."""
        self._held += text
        out: list[dict[str, Any]] = []
        while self._held:
            start = self._held.find(OPEN)
            if start < 0:
                keep = partial_suffix(self._held, OPEN)
                if len(self._held) > keep:
                    out.append({"content": self._held[: len(self._held) - keep]})
                    self._held = self._held[len(self._held) - keep:]
                break
            if start:
                out.append({"content": self._held[:start]})
                self._held = self._held[start:]
            end = self._held.find(CLOSE)
            if end < 0:
                break  # inside a block: wait for its end
            block, self._held = self._held[len(OPEN): end], self._held[end + len(CLOSE):]
            call = to_call(block.strip())
            if call is None:
                out.append({"content": OPEN + block + CLOSE})
            else:
                out.append({"tool_calls": [{"index": self.calls, **call}]})
                self.calls += 1
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What is still held when the answer ends (an unclosed block is content)."""
        held, self._held = self._held, ""
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
            except ValueError:
                pass  # the template writes it as it came
        out.append({**c, "function": f})
    return {**m, "tool_calls": out}
