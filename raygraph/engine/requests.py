"""The requests in flight as the engine's event loop sees them, and incremental
detokenization with stop strings; the step thread owns their sequences."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from raygraph.errors import failure
from raygraph.protocol import (
    FinishReason,
    GenerateResult,
    RequestTiming,
    SamplingParams,
    StreamDelta,
    TokenLogprobs,
)
from raygraph.tokenizer import TextTokenizer

# tokens for one request from the step thread: (seq id, new tokens, finish reason, whether
# the tokens are the whole output, their logprobs (the whole output's when whole; [] when
# not asked for), when the sequence was first scheduled)
Emitted = tuple[int, list[int], FinishReason | None, bool, list[TokenLogprobs], float]


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
    bad_request: bool = False  # the error was the request's own doing (errors.failure)
    submitted: float = field(default_factory=time.perf_counter)
    scheduled: float = 0.0
    first_token: float = 0.0
    timing: RequestTiming | None = None
    stop_token_ids: frozenset[int] = frozenset()
    stop_reason: str | int | None = None  # GenerateResult.stop_reason


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

    def fail(self, msg: str, seq_ids: list[int] | None = None,
             bad_request: bool = False) -> None:
        """Every request in flight (or those of `seq_ids`) ends with the error
        (`bad_request`: their own doing)."""
        ids = list(self.requests) if seq_ids is None else seq_ids
        for req in [self.requests.pop(i) for i in ids if i in self.requests]:
            req.error, req.bad_request = msg, bad_request
            req.finish_reason = "error"
            req.deltas.put_nowait(StreamDelta(req.seq_id, [], None, "error", error=msg,
                                              bad_request=bad_request))

    async def result(self, req: Request) -> GenerateResult:
        """The whole result once the request ends (its `errors.failure` if it failed)."""
        while True:
            delta = await req.deltas.get()
            if delta.finish_reason is not None:
                break
        if req.error:
            raise failure(req.error, req.bad_request)
        return GenerateResult(req.seq_id, req.prompt_token_ids, req.token_ids,
                              req.detok.text if self.tokenizer else None, req.finish_reason,
                              logprobs=req.logprobs if req.want_logprobs else None,
                              timing=req.timing, stop_reason=req.stop_reason)
