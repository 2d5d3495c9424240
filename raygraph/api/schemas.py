"""OpenAI request bodies (pydantic: FastAPI validates them and we turn its errors into
OpenAI's 400s) and the response pieces built from the coordinator's results."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raygraph.api.tools import template_message
from raygraph.protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    SamplingParams,
    TokenLogprobs,
)
from raygraph.tokenizer import TextTokenizer

# Every number is strict (no "5", no true for 1) and bounded to what SamplingParams and the
# workers accept, so an extreme value is pydantic's 400 here and never reaches a worker.
Count = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]
Seed = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]
TopLogprobs = Annotated[int, Field(strict=True, ge=0, le=20)]
# finite floats (NaN and infinities are 400s; ints are accepted)
Temperature = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0.0,
                                     le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0.0, le=1.0)]
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]
# choices (prompts x n) one completion request may ask for: each is a sequence held until it
# ends, so more is a 400 before any prompt is read (a batch job sends several requests)
MAX_SEQUENCES = 1024
# a request's token ids (all its prompts) and messages: a body of millions of tiny items
# takes seconds to validate on the HTTP actor's event loop, stalling its other streams, so
# longer lists are 400s counted before their items are read (a 1M-token context fits)
MAX_PROMPT_TOKENS = 1 << 20
MAX_MESSAGES = 1 << 14


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# Fields that ask for what raygraph does not do yet, with the values that ask for nothing
# (OpenAI's defaults). Any other value is a 400 naming the field: a client asking for a tool
# call must not get free text back as if it had been honoured.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema. The grammar enforces the schema whether or not
    `strict` is set."""

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra field: one of its constraints."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None


def structured_spec(kind: str, value: Any) -> dict[str, str]:
    """A StructuredOutputs for the coordinator: values that are not text become JSON."""
    try:
        return {"kind": kind, "value": value if isinstance(value, str) else json.dumps(value)}
    except RecursionError:  # a body parses a little deeper than json.dumps goes
        raise ValueError(f"structured output {kind}: nested too deeply") from None


ANY_OBJECT = {"type": "object"}


class _Sampling(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does
    for fields it does not know, except those asking for features not built (UNSUPPORTED)."""

    model: StrictStr | None = None
    max_tokens: Count | None = None
    # None: not given; the model's generation_config.json defaults apply, else greedy
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=16)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None \
        = None
    seed: Seed | None = None
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # extras (vLLM's names)
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX)] | None = None  # 0, -1: off
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    # structured outputs: OpenAI's field, vLLM's, and vLLM's older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # refused unless they ask for nothing (UNSUPPORTED)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None  # vLLM's
    min_tokens: Any = None  # vLLM's
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def params(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields for the coordinator (validated there, and by `check`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        out: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p,
            "top_k": 0 if self.top_k == -1 else self.top_k, "seed": self.seed, "stop": stop,
            "stop_token_ids": self.stop_token_ids or [], "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
        }
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        structured = self.structured()
        if structured is not None:
            out["structured"] = structured
        return out

    def structured(self) -> dict[str, str] | None:
        """The one output constraint asked for (None: free text); two are a 400."""
        given = []
        f = self.response_format
        if f is not None and f.type == "json_object":
            given.append(("response_format", structured_spec("json", ANY_OBJECT)))
        elif f is not None and f.type == "json_schema":
            if f.json_schema is None or f.json_schema.schema_ is None:
                raise ValueError("response_format: json_schema needs json_schema.schema")
            given.append(("response_format", structured_spec("json", f.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            kinds = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex),
                                         ("choice", so.choice), ("grammar", so.grammar),
                                         ("json", ANY_OBJECT if so.json_object else None))
                     if v is not None]
            if len(kinds) != 1:
                raise ValueError("structured_outputs: give exactly one of json, json_object, "
                                 "regex, choice, grammar")
            given.append(("structured_outputs", structured_spec(*kinds[0])))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, structured_spec(kind, getattr(self, name))))
        if len(given) > 1:
            raise ValueError(f"{' and '.join(n for n, _ in given)}: give one output "
                             "constraint")
        return given[0][1] if given else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @model_validator(mode="after")
    def _one_constraint(self) -> _Sampling:
        self.structured()  # ValueError: two constraints, or a json_schema without schema
        return self

    # the UNSUPPORTED fields this route refuses (the chat route takes tools)
    refused: ClassVar[tuple[str, ...]] = tuple(UNSUPPORTED)

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _refuse_unbuilt(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.refused and value not in UNSUPPORTED[info.field_name]:
            raise ValueError("not supported by this server yet; the request was not run")
        return value


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16  # OpenAI's default for completions
    logprobs: TopLogprobs | None = None  # top alternatives per token

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """At most MAX_SEQUENCES prompts and MAX_PROMPT_TOKENS token ids, counted before
        their items are validated, and a token id out of range named (the union's own error
        would name its first branch)."""
        if not isinstance(prompt, list):
            return prompt
        if prompt and type(prompt[0]) is not int:  # prompts: strings or lists of ids
            if len(prompt) > MAX_SEQUENCES:
                raise ValueError(f"at most {MAX_SEQUENCES} prompts a request, got "
                                 f"{len(prompt)}")
            total = sum(len(p) for p in prompt if isinstance(p, list))
        else:
            total = len(prompt)
        if total > MAX_PROMPT_TOKENS:
            raise ValueError(f"at most {MAX_PROMPT_TOKENS} token ids a request, got {total}")
        if all(type(t) is int for t in prompt):
            if prompt and not 0 <= min(prompt) <= max(prompt) <= INT32_MAX:
                bad = next(t for t in prompt if not 0 <= t <= INT32_MAX)
                raise ValueError(f"token id {bad} is not in [0, {INT32_MAX}]")
        return prompt

    @model_validator(mode="after")
    def _few_choices(self) -> CompletionRequest:
        p = self.prompt
        prompts = len(p) if isinstance(p, list) and p and type(p[0]) is not int else 1
        if prompts * self.n > MAX_SEQUENCES:
            raise ValueError(f"{prompts} prompts x n={self.n} choices: at most {MAX_SEQUENCES} "
                             "a request")
        return self

    @property
    def given_max_tokens(self) -> int | None:
        """The completion's length limit, when the client gave one (not the default)."""
        return self.max_tokens if "max_tokens" in self.model_fields_set else None


class LoadLoRARequest(BaseModel):
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRARequest(BaseModel):
    lora_name: StrictStr


class ContentPart(BaseModel):
    """One part of a message's content."""

    type: StrictStr
    text: StrictStr | None = None


class CalledFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"  # OpenAI sends JSON text


class ToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None  # a tool result's call
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart] | None) -> Any:
        """Text parts only: an image or audio part is a 400, never dropped (the model would
        answer without having seen it)."""
        for part in content if isinstance(content, list) else []:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported: "
                                 "text only")
        return content

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # an assistant's may be calls
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> dict[str, Any]:
        """The message for the chat template: content parts joined into one string; an
        assistant's tool calls and a tool result's call id as the templates read them."""
        c = self.content
        if isinstance(c, list):
            c = "".join(p.text or "" for p in c if p.type == "text")
        out: dict[str, Any] = {"role": self.role, "content": c or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return template_message(out)


class ToolFunction(BaseModel):
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


def few_items(items: Any) -> Any:
    """A list field of at most MAX_MESSAGES items, each message's content parts and tool
    calls counted too, before any is validated (a before-validator's body)."""
    if not isinstance(items, list):
        return items
    n = len(items)
    if n <= MAX_MESSAGES:
        n += sum(len(v) for m in items if isinstance(m, dict)
                 for v in (m.get("content"), m.get("tool_calls")) if isinstance(v, list))
    if n > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} items a request (messages, their content "
                         f"parts and tool calls), got {n}")
    return items


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. enable_thinking
    refused: ClassVar[tuple[str, ...]] = tuple(k for k in UNSUPPORTED
                                               if k not in ("tools", "tool_choice"))

    @field_validator("messages", "tools", mode="before")
    @classmethod
    def _few_items(cls, items: Any) -> Any:
        return few_items(items)

    @property
    def tools_active(self) -> bool:
        """Whether the template gets the tools and the answer is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The functions a call must be of ("required": any tool; a named choice: that
        one); None when the model may answer in text."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools or []]
        if not functions:
            raise ValueError("tool_choice: no tools given")
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f["name"] == choice.function.name]
            if not functions:
                raise ValueError(f"tool_choice: no tool named {choice.function.name!r}")
        return functions

    def structured(self) -> dict[str, str] | None:
        """The output format asked for; a forced tool_choice's grammar is the route's (it
        depends on the model's call format)."""
        spec = super().structured()
        forced = self.forced_tools()  # ValueError: a choice the tools do not have
        if spec is not None and forced is not None:
            raise ValueError("tool_choice and an output format: give one output constraint")
        return spec

    @property
    def given_max_tokens(self) -> int | None:
        """The completion's length limit, when the client gave one."""
        return self.max_completion_tokens or self.max_tokens


def check_params(fields: dict[str, Any]) -> SamplingParams:
    """Validate here first (a bad request never reaches the coordinator); BadRequest."""
    from raygraph.requests import parse_params

    return parse_params(fields)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope(kind: str, rid: str, model: str, choices: list[dict], usage: dict | None,
             with_usage: bool = True) -> dict:
    """A response or stream chunk: `kind` is OpenAI's object name."""
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
           "choices": choices}
    if with_usage:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# vLLM's floor: -inf (a token the sampler's filters removed) and NaN would make invalid JSON
LOGPROB_FLOOR = -9999.0


def finite_logprob(v: float) -> float:
    return v if math.isfinite(v) and v > LOGPROB_FLOOR else LOGPROB_FLOOR


class Logprobs:
    """OpenAI's two logprob shapes from TokenLogprobs; token strings from the tokenizer.
    Values are clamped to LOGPROB_FLOOR, so the JSON is always valid."""

    def __init__(self, tokenizer: TextTokenizer | None) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], lps: list[TokenLogprobs],
                   offset: int = 0) -> dict:
        """`logprobs` of a completions choice (text_offset counts from `offset`)."""
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        top = []
        for t, lp in zip(token_ids, lps):
            alts = {self.token(i): finite_logprob(v)
                    for i, v in zip(lp.top_ids, lp.top_logprobs)}
            alts.setdefault(self.token(t), finite_logprob(lp.logprob))
            top.append(alts)
        return {"tokens": tokens, "token_logprobs": [finite_logprob(lp.logprob) for lp in lps],
                "top_logprobs": top, "text_offset": offsets}

    def chat(self, token_ids: list[int], lps: list[TokenLogprobs]) -> dict:
        """`logprobs` of a chat choice."""
        def entry(token_id: int, logprob: float) -> dict:
            s = self.token(token_id)
            return {"token": s, "logprob": finite_logprob(logprob), "bytes": list(s.encode())}

        return {"content": [
            {**entry(t, lp.logprob),
             "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
            for t, lp in zip(token_ids, lps)]}


def json_text(obj: Any) -> str:
    """JSON as every response and SSE event is written: NaN and infinities are refused (they
    are not JSON), as Starlette's JSONResponse refuses them."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an aborted request ends as stop."""
    return None if reason is None else "length" if reason == "length" else "stop"
