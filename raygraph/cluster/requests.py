"""The client side of the coordinator, kept apart from the step loop: input checking, the
requests in flight as the event loop sees them, incremental detokenization."""

from __future__ import annotations

import array
import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from raygraph.protocol import (
    FinishReason,
    GenerateResult,
    RequestTiming,
    SamplingParams,
    StreamDelta,
    TokenLogprobs,
)
from raygraph.tokenizer import TextTokenizer


class BadRequest(ValueError):
    """The request cannot be served as given; nothing was scheduled."""


# tokens for one request from the step thread: (seq id, new tokens, finish reason, whether
# the tokens are the whole output, their logprobs (the whole output's when whole; [] when
# not asked for), when the sequence was first scheduled)
Emitted = tuple[int, list[int], FinishReason | None, bool, list[TokenLogprobs], float]


class WorkerFailure(RuntimeError):
    """A worker died or failed a step; the requests in flight were failed with this."""


class Asleep(RuntimeError):
    """The workers sleep (or are about to): nothing was scheduled; wake them up first."""


class Busy(RuntimeError):
    """Requests are in flight and the caller asked not to wait for them (sleep)."""


def parse_params(params: Any) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        params = msgspec.structs.asdict(params)  # re-validate: Structs skip checks on init
    try:
        return msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as e:
        raise BadRequest(f"invalid sampling params: {e}") from None


def split_prompts(prompts: Any) -> list[str | list[int]]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, list | tuple) and len(prompts) == 0:
        raise BadRequest("empty prompt")
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(type(t) is int for t in prompts)
    ):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts:
        return list(prompts)
    raise BadRequest(
        f"prompts must be a string, a list of token ids, or a non-empty list of those; "
        f"got {type(prompts).__name__}"
    )


_PACK = "I" if array.array("I").itemsize == 4 else ""  # uint32 in native order


def pack_ids(ids: list[int]) -> bytes | list[int]:
    """Token ids for a coordinator call, packed as uint32: a 64-prompt burst of 1088 tokens
    went from ~8 ms to ~4 ms through Ray (a list pickles each int), and the coordinator checks
    the packed ids in C. Ids that do not fit go as given: the coordinator says why."""
    if not _PACK:
        return ids
    try:
        return array.array(_PACK, ids).tobytes()
    except (OverflowError, TypeError):
        return ids


def encode_prompt(prompt: Any, tokenizer: TextTokenizer | None, vocab_size: int) -> list[int]:
    """Token ids as given (checked against the vocabulary), or packed (pack_ids), or text
    encoded exactly as transformers' AutoTokenizer does (BOS only where the tokenizer adds
    it)."""
    if isinstance(prompt, bytes):
        if len(prompt) % 4:
            raise BadRequest(f"packed token ids of {len(prompt)} bytes: not uint32s")
        packed = np.frombuffer(prompt, dtype=np.uint32)
        if not len(packed):
            raise BadRequest("empty prompt")
        if int(packed.max()) >= vocab_size:
            bad = packed[packed >= vocab_size][:5].tolist()
            raise BadRequest(f"token ids {bad} are outside the vocabulary [0, {vocab_size})")
        return packed.tolist()
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send token ids, not text")
        if not prompt:
            raise BadRequest("empty prompt")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise BadRequest("the prompt encodes to no tokens")
        return ids
    if not isinstance(prompt, list | tuple) or not all(type(t) is int for t in prompt):
        kind = type(prompt).__name__
        raise BadRequest(f"a prompt must be a string or a list of ints, got {kind}")
    if not prompt:
        raise BadRequest("empty prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return list(prompt)


class Detokenizer:
    """Text of one request's output so far, decoded incrementally, with stop strings.

    Each step decodes only a short window of tokens (from `prefix` on) rather than the
    whole output: the coordinator's loop does this for every running request every step.
    """

    def __init__(self, tokenizer: TextTokenizer | None, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.prefix = 0  # window start: text before it is final
        self.read = 0  # tokens already turned into self.text

    def update(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed the whole output so far; returns (new text, the stop string that ended it)."""
        if self.tokenizer is None:
            return "", None
        decode = self.tokenizer.decode
        before = decode(token_ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(token_ids[self.prefix :], skip_special_tokens=True)
        # an unfinished UTF-8 sequence (or a token with no text): wait for more tokens
        if after.endswith("\ufffd") or len(after) <= len(before):
            return "", None
        self.prefix, self.read = self.read, len(token_ids)
        old = self.text
        text = old + after[len(before) :]
        hit = None
        for s in self.stop:
            at = text.find(s, max(0, len(old) - len(s)))
            if at >= 0:
                text, hit = text[:at], s
        self.text = text
        return text[len(old) :], hit


@dataclass
class Request:
    """A client request, as the event loop sees it (the step thread owns its Sequence)."""

    seq_id: int
    prompt_token_ids: list[int]
    detok: Detokenizer
    stream: bool  # a delta per token; else one at the end
    want_logprobs: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    deltas: asyncio.Queue[StreamDelta] = field(default_factory=asyncio.Queue)
    finish_reason: FinishReason | None = None
    error: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    scheduled: float = 0.0
    first_token: float = 0.0
    timing: RequestTiming | None = None
    stop_token_ids: frozenset[int] = frozenset()
    stop_reason: str | int | None = None  # GenerateResult.stop_reason


def take_deltas(queue: asyncio.Queue[StreamDelta], first: StreamDelta) -> StreamDelta:
    """`first` and every delta already queued behind it, as one: a stream whose client (or
    Ray's per-item cost, ~0.2 ms a yield on the coordinator) lags the steps gets several
    tokens a message instead of falling further behind."""
    delta = first
    while delta.finish_reason is None and not queue.empty():
        more = queue.get_nowait()
        delta = StreamDelta(
            delta.request_id, delta.token_ids + more.token_ids,
            None if delta.text is None else delta.text + (more.text or ""),
            more.finish_reason,
            None if delta.logprobs is None else delta.logprobs + (more.logprobs or []),
            more.timing, more.stop_reason, more.error)
    return delta


class RequestTable:
    """The requests in flight, on the coordinator's event loop: tokens in, text and stream
    deltas out. `on_stop_string(seq_id)` tells the step loop a stop string ended one."""

    def __init__(self, tokenizer: TextTokenizer | None,
                 on_stop_string: Callable[[int], None]) -> None:
        self.tokenizer = tokenizer
        self.on_stop_string = on_stop_string
        self.requests: dict[int, Request] = {}
        self.ttft_s = 0.0  # submission to first token, summed over requests
        self.first_tokens = 0
        # finished requests (the counters /metrics exports): tokens as their clients got them
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # by finish reason

    def add(self, seq_id: int, prompt: list[int], params: SamplingParams,
            stream: bool) -> Request:
        req = Request(seq_id, prompt, Detokenizer(self.tokenizer, params.stop), stream,
                      params.logprobs is not None,
                      stop_token_ids=frozenset(params.stop_token_ids))
        self.requests[seq_id] = req
        return req

    def emit(self, items: list[Emitted]) -> None:
        """Tokens to their requests (text, stop strings, streams)."""
        for seq_id, tokens, reason, whole, logprobs, scheduled in items:
            req = self.requests.get(seq_id)
            if req is None:
                continue  # already finished (a stop string): a token past the stop
            if not req.token_ids:
                req.first_token, req.scheduled = time.perf_counter(), scheduled
                self.ttft_s += req.first_token - req.submitted
                self.first_tokens += 1
            if whole:
                req.token_ids, req.logprobs = tokens, logprobs
            else:
                req.token_ids += tokens
                req.logprobs += logprobs
            if not req.stream and reason is None and not req.detok.stop:
                continue  # nothing to tell yet; the text is decoded once, at the end
            text, stop_string = req.detok.update(req.token_ids)
            if stop_string is not None and reason is None:
                reason, req.stop_reason = "stop", stop_string
                self.on_stop_string(seq_id)
            elif reason == "stop" and req.token_ids[-1] in req.stop_token_ids:
                req.stop_reason = req.token_ids[-1]
            if reason is not None:
                self._finish(req, reason)
            req.deltas.put_nowait(StreamDelta(
                seq_id, tokens, text if self.tokenizer else None, reason,
                logprobs if req.want_logprobs else None, req.timing, req.stop_reason))

    def _finish(self, req: Request, reason: FinishReason) -> None:
        now = time.perf_counter()
        req.finish_reason = reason
        req.timing = RequestTiming(max(0.0, req.scheduled - req.submitted),
                                   req.first_token - req.submitted, now - req.submitted)
        self.prompt_tokens += len(req.prompt_token_ids)
        self.generation_tokens += len(req.token_ids)
        self.finished[reason] += 1
        del self.requests[req.seq_id]

    def abort(self, seq_id: int) -> bool:
        """Forget a request whose client went away (counted as "abort"); whether it ran."""
        req = self.requests.pop(seq_id, None)
        if req is None:
            return False
        req.finish_reason = "abort"
        self.finished["abort"] += 1
        return True

    def fail(self, msg: str, seq_ids: list[int] | None = None) -> None:
        """Every request in flight (or those of `seq_ids`) ends with the error."""
        ids = list(self.requests) if seq_ids is None else seq_ids
        for req in [self.requests.pop(i) for i in ids if i in self.requests]:
            req.error = msg
            req.finish_reason = "error"
            req.deltas.put_nowait(StreamDelta(req.seq_id, [], None, "error", error=msg))

    async def result(self, req: Request) -> GenerateResult:
        """The whole result once the request ends (WorkerFailure if it failed)."""
        while True:
            delta = await req.deltas.get()
            if delta.finish_reason is not None:
                break
        if req.error:
            raise WorkerFailure(req.error)
        return GenerateResult(req.seq_id, req.prompt_token_ids, req.token_ids,
                              req.detok.text if self.tokenizer else None, req.finish_reason,
                              logprobs=req.logprobs if req.want_logprobs else None,
                              timing=req.timing, stop_reason=req.stop_reason)
