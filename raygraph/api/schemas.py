"""OpenAI request bodies (pydantic: FastAPI validates them and we turn its errors into
OpenAI's 400s) and the response pieces built from the coordinator's results."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, Field

from raygraph.protocol import SamplingParams, TokenLogprobs
from raygraph.tokenizer import TextTokenizer


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share; unknown fields are ignored, as OpenAI's own server does
    for fields it does not know. Value ranges are checked by `SamplingParams` (400s)."""

    model: str | None = None
    max_tokens: int | None = None
    # None: not given; the model's generation_config.json defaults apply, else greedy
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extras (vLLM's names)
    top_k: int | None = None  # 0 or -1: off
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

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
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top alternatives per token


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> dict[str, str]:
        """The message for the chat template: content parts joined into one string."""
        c = self.content
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if p.get("type") == "text")
        return {"role": self.role, "content": c or ""}


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


def check_params(fields: dict[str, Any]) -> SamplingParams:
    """Validate here first (a bad request never reaches the coordinator); BadRequest."""
    from raygraph.cluster.requests import parse_params

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


class Logprobs:
    """OpenAI's two logprob shapes from TokenLogprobs; token strings from the tokenizer."""

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
            alts = {self.token(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
            alts.setdefault(self.token(t), lp.logprob)
            top.append(alts)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": top, "text_offset": offsets}

    def chat(self, token_ids: list[int], lps: list[TokenLogprobs]) -> dict:
        """`logprobs` of a chat choice."""
        def entry(token_id: int, logprob: float) -> dict:
            s = self.token(token_id)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

        return {"content": [
            {**entry(t, lp.logprob),
             "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
            for t, lp in zip(token_ids, lps)]}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an aborted request ends as stop."""
    return None if reason is None else "length" if reason == "length" else "stop"
