"""OpenAI's Responses API (`POST /v1/responses`), stateless (HTTP front): a request becomes
the chat request it means (input items as messages, instructions as the system message,
flat function tools, `text.format` as response_format), runs through the chat machinery,
and its answer comes back as output items (reasoning, message, function calls), whole or as
Responses stream events. Nothing is stored: `previous_response_id` is refused."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from raygraph.api.errors import first_problem
from raygraph.api.schemas import ChatRequest, Count, Temperature, TopP, few_items


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[str, Any] | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    chat: Any = None  # the ChatRequest it means, built by the validator

    @field_validator("input", "tools", mode="before")
    @classmethod
    def _few_items(cls, items: Any) -> Any:
        return few_items(items)

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server stores no responses; send the "
                             "whole conversation as input")
        for key in ("metadata", "text", "tools", "tool_choice"):  # echoed in the Response
            try:  # as the response will encode it
                json.dumps(getattr(self, key), allow_nan=False, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise ValueError(f"{key}: text with a lone surrogate is not UTF-8") from None
            except ValueError:
                raise ValueError(f"{key}: NaN and infinities are not JSON") from None
            except RecursionError:
                raise ValueError(f"{key}: nested too deeply") from None
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        for key in ("model", "temperature", "top_p", "user"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise ValueError("text.format must be an object")
        if fmt is not None:
            body["response_format"] = chat_format(fmt)
        try:
            self.chat = ChatRequest.model_validate(body)
        except ValidationError as e:  # one line naming the field, as a 400
            problem = first_problem(e.errors())[0]
            if problem.startswith("messages"):  # built from input (and instructions)
                problem = "input" + problem[len("messages"):]
            raise ValueError(problem) from None
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions first, a function call joined to
        the assistant message before it, a function call's output as a tool message."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) \
            else self.input
        for item in items:
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise ValueError(f"input: a message's role must be user, assistant, "
                                     f"system or developer, got {role!r}")
                out.append({"role": "system" if role == "developer" else role,
                            "content": item_text(item.get("content"))})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"),
                                     "arguments": item.get("arguments", "{}")}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str) else item_text(output)})
            elif kind != "reasoning":  # earlier reasoning is not sent back to the model
                raise ValueError(f"input: items of type {kind!r} are not supported")
        return out


def item_text(content: Any) -> str:
    """A message's content: text, or its text parts joined (any other part is a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | None):
        raise ValueError("input: a message's content must be text or a list of parts")
    parts = []
    for part in content or []:
        if not isinstance(part, dict):
            raise ValueError("input: a content part must be an object")
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise ValueError(f"input: content parts of type {part.get('type')!r} are not "
                             "supported: text only")
        text = part.get("text") or ""
        if not isinstance(text, str):
            raise ValueError("input: a text part's text must be a string")
        parts.append(text)
    return "".join(parts)


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool; built-in tools are refused."""
    if tool.get("type") != "function":
        raise ValueError(f"tools: only function tools are supported, got {tool.get('type')!r}")
    return {"type": "function", "function": {k: tool[k] for k in
                                             ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """`text.format` (flat) as chat's response_format."""
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in
                                                   ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message (api/answers.answer) as Responses output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call))
    return items


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, status: str = "completed", item_id: str | None = None
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_item_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    f = call["function"]
    return {"type": "function_call", "id": new_item_id("fc"), "call_id": call["id"],
            "name": f["name"], "arguments": f["arguments"], "status": "completed"}


def response_object(body: ResponsesRequest, rid: str, model: str, items: list[dict[str, Any]],
                    prompt_tokens: int, output_tokens: int,
                    status: Literal["in_progress", "completed", "incomplete"]) -> dict[str, Any]:
    """The Response, as OpenAI returns it (and as `response.created`/`completed` carry it)."""
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status, "output": items, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls, "temperature": body.temperature,
        "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
        "store": False, "metadata": body.metadata or {}, "previous_response_id": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
                  "total_tokens": prompt_tokens + output_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


class ResponseEvents:
    """Chat answer deltas (api/answers.AnswerStream) -> Responses stream events, each with
    its sequence number: an output item opens when its first part arrives and is done when
    another kind of part starts or the answer ends."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # finished output items
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq, **fields}

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if "reasoning_content" in d:
                out += self._text("reasoning", d["reasoning_content"])
            elif "content" in d:
                out += self._text("message", d["content"])
            for call in d.get("tool_calls", []):
                out += self.close()
                item = call_item(call)
                index = len(self.items)
                out.append(self.event("response.output_item.added", output_index=index,
                                      item={**item, "arguments": "", "status": "in_progress"}))
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index,
                                      delta=item["arguments"]))
                out.append(self.event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))
                out.append(self.event("response.output_item.done", output_index=index,
                                      item=item))
                self.items.append(item)
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is not None and self._open["type"] != kind:
            out += self.close()
        index = len(self.items)
        if self._open is None:
            self._open = {"type": kind, "id": new_item_id("rs" if kind == "reasoning"
                                                          else "msg"), "text": ""}
            empty = reasoning_item("") if kind == "reasoning" else message_item("")
            item = {**empty, "id": self._open["id"], "status": "in_progress", "content": []}
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=item))
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part={"type": "output_text", "text": "",
                                            "annotations": []}))
        self._open["text"] += text
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                  output_index=index, content_index=0, delta=text))
        else:
            out.append(self.event("response.output_text.delta", item_id=self._open["id"],
                                  output_index=index, content_index=0, delta=text,
                                  logprobs=[]))
        return out

    def failed(self, response: dict[str, Any], code: str, message: str,
               param: str | None) -> list[dict[str, Any]]:
        """A stream that fails after its 200: an `error` event, then `response.failed` with
        the items finished so far (the text sent stays with the client)."""
        failed = {**response, "status": "failed", "output": self.items,
                  "error": {"code": code, "message": message}}
        return [self.event("error", code=code, message=message, param=param),
                self.event("response.failed", response=failed)]

    def close(self) -> list[dict[str, Any]]:
        """The open text item's done events."""
        if self._open is None:
            return []
        o, self._open = self._open, None
        index = len(self.items)
        if o["type"] == "reasoning":
            item = {**reasoning_item(o["text"]), "id": o["id"]}
            out = [self.event("response.reasoning_text.done", item_id=o["id"],
                              output_index=index, content_index=0, text=o["text"])]
        else:
            item = message_item(o["text"], item_id=o["id"])
            part = item["content"][0]
            out = [self.event("response.output_text.done", item_id=o["id"],
                              output_index=index, content_index=0, text=o["text"],
                              logprobs=[]),
                   self.event("response.content_part.done", item_id=o["id"],
                              output_index=index, content_index=0, part=part)]
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return out
