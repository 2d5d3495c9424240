"""The OpenAI-compatible FastAPI app over a coordinator handle. It only translates:
validates, tokenizes, calls the coordinator (`generate`; streams over one subscription per
replica, `cluster/streams.py`; `stats`, sleep/wake) and streams back as SSE; no scheduling
happens here."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from raygraph.api.chat import ChatTemplate
from raygraph.api.errors import ApiError, error_response, translate
from raygraph.api.metrics import Metrics
from raygraph.api.schemas import (
    ChatRequest,
    CompletionRequest,
    LoadLoRARequest,
    Logprobs,
    UnloadLoRARequest,
    check_params,
    envelope,
    finish_reason,
    new_id,
    usage,
)
from raygraph.cluster.requests import encode_prompt, split_prompts
from raygraph.cluster.streams import StreamHub
from raygraph.config import ModelConfig
from raygraph.protocol import GenerateResult, SamplingParams, StreamDelta
from raygraph.tokenizer import load_tokenizer


class HttpConfig(msgspec.Struct, frozen=True):
    """The HTTP front door (`raygraph serve` flags)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    api_key: str | None = None  # set: /v1, /sleep and /wake_up need `Bearer <key>`
    served_model_name: str | None = None  # None: the checkpoint directory's name
    chat_template: str | None = None  # a Jinja template's text; None: the checkpoint's
    probe_timeout_s: float = 5.0  # /health and /metrics calls to the coordinator
    # API server actors sharing the port (SO_REUSEPORT: the kernel spreads connections):
    # one Python process sends a few thousand SSE chunks a second
    replicas: int = 1


# one SSE stream per choice: (choice index, prompt token ids, params)
Choice = tuple[int, list[int], SamplingParams]


class Front:
    """What the routes share: the coordinator, the model's facts, tokenizer and metrics."""

    def __init__(self, coord: Any, cfg: HttpConfig, info: dict) -> None:
        self.coord, self.cfg = coord, cfg
        model_dir = info["model"]
        self.name = cfg.served_model_name or Path(model_dir).name
        self.max_model_len = info["max_model_len"]
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
        self.logprobs = Logprobs(self.tokenizer)
        self.chat = ChatTemplate(self.tokenizer, model_dir, cfg.chat_template)
        self.metrics = Metrics(self.name)
        self.streams = StreamHub(coord)

    # ---- requests in ------------------------------------------------------------------
    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the served model); the
        coordinator refuses a name it does not know (404 model_not_found)."""
        return None if model is None or model == self.name else model

    def encode(self, prompt: Any) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.vocab_size)

    @staticmethod
    def choices(prompts: list[list[int]], sp: SamplingParams, n: int) -> list[Choice]:
        """n samples per prompt, choice index prompt * n + sample; seeded samples get
        seed, seed + 1, ... so they differ and each is reproducible. NOTE: the n sequences
        are independent: they do not share the prompt's KV blocks yet (prefix caching)."""
        out = []
        for j, ids in enumerate(prompts):
            for i in range(n):
                seed = None if sp.seed is None else sp.seed + i
                out.append((j * n + i, ids, msgspec.structs.replace(sp, seed=seed)))
        return out

    # ---- coordinator calls --------------------------------------------------------------
    async def generate(self, choices: list[Choice]) -> list[GenerateResult]:
        """Every choice, in order. Choices differ only by seed: those with the same seed go
        in one call (batched)."""
        groups: dict[int | None, list[Choice]] = {}
        for c in choices:
            groups.setdefault(c[2].seed, []).append(c)
        try:
            outs = await asyncio.gather(*(self.coord.generate.remote([c[1] for c in g], g[0][2])
                                          for g in groups.values()))
        except Exception as e:
            raise translate(e) from None
        results: dict[int, GenerateResult] = {}
        for g, rs in zip(groups.values(), outs):
            for c, r in zip(g, rs):
                results[c[0]] = r
                self.metrics.finished(r.timing, len(r.token_ids))
        return [results[c[0]] for c in choices]

    async def open_streams(self, choices: list[Choice]
                           ) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Start a stream per choice and wait for each one's first delta, so a refused
        request fails before any byte is sent; then the merged deltas, as they come."""
        hub = self.streams
        opened = await asyncio.gather(*(hub.open(ids, sp) for _, ids, sp in choices),
                                      return_exceptions=True)
        rids = [r for r in opened if isinstance(r, int)]
        try:
            failed = next((e for e in opened if isinstance(e, BaseException)), None)
            if failed is not None:
                raise failed
            firsts = await asyncio.gather(*(hub.next(r) for r in rids))
        except Exception as e:
            hub.cancel(rids)
            raise translate(e) from None
        return self._merge([c[0] for c in choices], rids, firsts)

    async def _merge(self, indices: list[int], rids: list[int], firsts: list[StreamDelta]
                     ) -> AsyncIterator[tuple[int, StreamDelta]]:
        queue: asyncio.Queue = asyncio.Queue()
        done: set[int] = set()

        async def pump(index: int, rid: int, delta: StreamDelta) -> None:
            gaps, tokens, last = [], 0, time.perf_counter()
            gap = 0.0  # before this delta
            try:
                while True:
                    n = len(delta.token_ids)
                    # one gap a token after the first: a delta's tokens after its first came
                    # together (merged while this replica was busy)
                    gaps += ([gap] if tokens and n else []) + [0.0] * max(0, n - 1)
                    tokens += n
                    await queue.put((index, delta))
                    if delta.finish_reason is not None:
                        done.add(rid)
                        self.metrics.finished(delta.timing, tokens, gaps)
                        return
                    delta = await self.streams.next(rid)
                    now = time.perf_counter()
                    gap, last = now - last, now
            except Exception as e:
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(*a)) for a in zip(indices, rids, firsts)]
        try:
            left = len(tasks)
            while left:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise translate(item)
                yield index, item
                left -= item.finish_reason is not None
        finally:  # the client went away, or a stream failed: stop the others
            for t in tasks:
                t.cancel()
            self.streams.cancel([r for r in rids if r not in done])

    async def probe(self) -> tuple[bool, str]:
        """(serving, why not) from the coordinator."""
        try:
            stats = await asyncio.wait_for(self.coord.stats.remote(), self.cfg.probe_timeout_s)
            if not stats["healthy"]:
                return False, f"not serving: {stats['reason'] or 'not started'}"
            if await self.coord.is_sleeping.remote():
                return False, "asleep; POST /wake_up"
        except asyncio.TimeoutError:
            return False, f"the coordinator did not answer in {self.cfg.probe_timeout_s}s"
        except Exception as e:
            return False, translate(e).message
        return True, "ok"

    async def stats(self) -> tuple[dict, int]:
        """The coordinator's stats and, with weight offload, the bytes it copied."""
        try:
            stats = await asyncio.wait_for(self.coord.stats.remote(), self.cfg.probe_timeout_s)
            h2d = 0
            if stats.get("offload"):
                ranks = await self.coord.worker_stats.remote()
                h2d = sum((r["offload"] or {}).get("bytes_copied", 0) for r in ranks)
        except Exception as e:
            raise translate(e) from None
        return stats, h2d


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def build_app(coord: Any, cfg: HttpConfig | None = None, info: dict | None = None) -> FastAPI:
    """The app over a coordinator handle; `info` is its `describe()` (read when None)."""
    import ray

    cfg = cfg or HttpConfig()
    front = Front(coord, cfg, info or ray.get(coord.describe.remote()))
    app = FastAPI(title="raygraph", docs_url=None, redoc_url=None)
    app.state.front = front

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"{type(e).__name__}: {e}", type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(ApiError(400, f"malformed JSON: {err.get('msg')}"))
        where = ".".join(loc)
        return error_response(ApiError(400, f"{where}: {err.get('msg')}" if where
                                       else str(err.get("msg")), where or None))

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {cfg.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                           code="invalid_api_key", type="authentication_error")

    @app.get("/health")
    async def health() -> Response:
        ok, why = await front.probe()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": why},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats, h2d = await front.stats()
        return Response(front.metrics.render(stats, h2d),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        """The served model, then its LoRA adapters (`parent`: the served model, as vLLM)."""
        authorize(request)
        try:
            adapters = await coord.list_lora_adapters.remote()
        except Exception as e:
            raise translate(e) from None
        card = {"object": "model", "created": 0, "owned_by": "raygraph",
                "max_model_len": front.max_model_len}
        return {"object": "list", "data": [
            {"id": front.name, "root": front.name, "parent": None, **card},
            *({"id": a["name"], "root": a["path"], "parent": front.name, **card}
              for a in adapters)]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> dict:
        """vLLM's route: register a PEFT adapter under a name (400 with the reason)."""
        authorize(request)
        try:
            return await coord.load_lora_adapter.remote(body.lora_name, body.lora_path)
        except Exception as e:
            raise translate(e) from None

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> dict:
        authorize(request)
        try:
            await coord.unload_lora_adapter.remote(body.lora_name)
        except Exception as e:
            raise translate(e) from None
        return {"lora_name": body.lora_name, "unloaded": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        authorize(request)
        lora = front.adapter(body.model)
        name = lora or front.name
        try:
            prompts = [front.encode(p) for p in split_prompts(body.prompt)]
            sp = check_params({**body.params(body.max_tokens, body.logprobs), "lora": lora})
        except ValueError as e:  # BadRequest
            raise translate(e) from None
        choices = front.choices(prompts, sp, body.n)
        rid, kind = new_id("cmpl"), "text_completion"
        prompt_tokens = sum(len(p) for p in prompts)
        want_lp = body.logprobs is not None
        if not body.stream:
            results = await front.generate(choices)
            out = [{"index": i, "text": r.text or "", "finish_reason": finish_reason(
                        r.finish_reason),
                    "logprobs": front.logprobs.completion(r.token_ids, r.logprobs or [])
                    if want_lp else None} for i, r in enumerate(results)]
            n = sum(len(r.token_ids) for r in results)
            return JSONResponse(envelope(kind, rid, name, out, usage(prompt_tokens, n)))
        deltas = await front.open_streams(choices)

        async def events() -> AsyncIterator[str]:
            offsets: dict[int, int] = {}
            n = 0
            async for i, d in deltas:
                n += len(d.token_ids)
                lp = None
                if want_lp:
                    lp = front.logprobs.completion(d.token_ids, d.logprobs or [],
                                                   offsets.get(i, 0))
                    offsets[i] = offsets.get(i, 0) + sum(len(t) for t in lp["tokens"])
                choice = {"index": i, "text": d.text or "", "logprobs": lp,
                          "finish_reason": finish_reason(d.finish_reason)}
                yield sse(envelope(kind, rid, name, [choice], None, body.include_usage))
            if body.include_usage:
                yield sse(envelope(kind, rid, name, [], usage(prompt_tokens, n)))
            yield sse("[DONE]")

        return StreamingResponse(_guard(events()), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        authorize(request)
        lora = front.adapter(body.model)
        name = lora or front.name
        chat_ids = front.chat.render([m.text() for m in body.messages])
        top = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens or body.max_tokens or front.max_model_len
        try:
            prompt = front.encode(chat_ids)
            sp = check_params({**body.params(max_tokens, top if body.logprobs else None),
                               "lora": lora})
        except ValueError as e:
            raise translate(e) from None
        choices = front.choices([prompt], sp, body.n)
        rid, kind = new_id("chatcmpl"), "chat.completion"
        if not body.stream:
            results = await front.generate(choices)
            out = [{"index": i, "message": {"role": "assistant", "content": r.text or ""},
                    "logprobs": front.logprobs.chat(r.token_ids, r.logprobs or [])
                    if body.logprobs else None,
                    "finish_reason": finish_reason(r.finish_reason)}
                   for i, r in enumerate(results)]
            n = sum(len(r.token_ids) for r in results)
            return JSONResponse(envelope(kind, rid, name, out, usage(len(prompt), n)))
        deltas = await front.open_streams(choices)
        kind = "chat.completion.chunk"

        async def events() -> AsyncIterator[str]:
            for i in range(len(choices)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}
                yield sse(envelope(kind, rid, name, [first], None, body.include_usage))
            n = 0
            async for i, d in deltas:
                n += len(d.token_ids)
                choice = {"index": i, "delta": {"content": d.text} if d.text else {},
                          "logprobs": front.logprobs.chat(d.token_ids, d.logprobs or [])
                          if body.logprobs else None,
                          "finish_reason": finish_reason(d.finish_reason)}
                yield sse(envelope(kind, rid, name, [choice], None, body.include_usage))
            if body.include_usage:
                yield sse(envelope(kind, rid, name, [], usage(len(prompt), n)))
            yield sse("[DONE]")

        return StreamingResponse(_guard(events()), media_type="text/event-stream")

    @app.post("/sleep")
    async def sleep(request: Request, level: int = 1, wait: bool = True) -> dict:
        authorize(request)
        if level not in (1, 2):
            raise ApiError(400, f"level must be 1 or 2, got {level}", "level")
        try:
            return await coord.sleep.remote(level, wait)
        except Exception as e:
            raise translate(e) from None

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict:
        authorize(request)
        try:
            return await coord.wake_up.remote()
        except Exception as e:
            raise translate(e) from None

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        try:
            return {"is_sleeping": await coord.is_sleeping.remote()}
        except Exception as e:
            raise translate(e) from None

    return app


async def _guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that fails after its 200 ends with an OpenAI error event, then [DONE]."""
    try:
        async for e in events:
            yield e
    except ApiError as e:
        yield sse(e.body())
        yield sse("[DONE]")
