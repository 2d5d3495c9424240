"""The OpenAI-compatible FastAPI app over a coordinator handle. It only translates:
validates, tokenizes, calls the coordinator (`generate`; streams over one subscription per
replica, `client/streams.py`; `stats`, sleep/wake) and streams back as SSE; no scheduling
happens here. The shared state and the coordinator calls are `front.Front`; the key and body
size checks run before any route (`middleware.FrontDoor`)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from raygraph.api.answers import AnswerStream, after_reasoning, answer, chat_chunks, ending
from raygraph.api.errors import ApiError, install_handlers, translate
from raygraph.api.front import BULK_CHARS, Choice, Front, HttpConfig, Merged
from raygraph.api.middleware import FrontDoor
from raygraph.api.responses import (
    ResponseEvents,
    ResponsesRequest,
    new_item_id,
    output_items,
    response_object,
)
from raygraph.api.schemas import (
    ChatRequest,
    CompletionRequest,
    LoadLoRARequest,
    UnloadLoRARequest,
    envelope,
    new_id,
    usage,
)

__all__ = ["HttpConfig", "build_app"]

Handler = Callable[..., Any]


def sse(obj: dict | str) -> bytes:
    """One server-sent event. msgspec writes it (a streamed chunk's JSON is most of the
    server's work per token); the values are finite already (Logprobs clamps them), and
    any other non-finite float would be written as null."""
    data = obj.encode() if isinstance(obj, str) else msgspec.json.encode(obj)
    return b"data: " + data + b"\n\n"


def event(obj: dict) -> bytes:
    """A Responses stream event: its type on an `event:` line too, as OpenAI's server sends."""
    return b"event: " + obj["type"].encode() + b"\n" + sse(obj)


def build_app(coord: Any, cfg: HttpConfig | None = None, info: dict | None = None) -> FastAPI:
    """The app over a coordinator handle; `info` is its `describe()` (read when None)."""
    import ray

    cfg = cfg or HttpConfig()
    front = Front(coord, cfg, info or ray.get(coord.describe.remote()))
    app = FastAPI(title="raygraph", docs_url=None, redoc_url=None)
    app.state.front = front
    install_handlers(app)
    app.add_middleware(FrontDoor, api_key=cfg.api_key, max_body_bytes=cfg.max_request_bytes)

    def get(path: str) -> Callable[[Handler], Handler]:
        """A GET route that answers HEAD too (its status and headers, no body), as probes and
        load balancers may ask; the HEAD route stays out of the OpenAPI schema (one
        operation id a path)."""
        def register(fn: Handler) -> Handler:
            app.api_route(path, methods=["HEAD"], include_in_schema=False)(fn)
            return app.get(path)(fn)
        return register

    @get("/health")
    async def health() -> Response:
        ok, why, replicas = await front.probe()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": why,
                             "replicas": replicas}, status_code=200 if ok else 503)

    @get("/metrics")
    async def metrics() -> Response:
        stats, h2d = await front.stats()
        return Response(front.metrics.render(stats, h2d),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @get("/v1/models")
    async def models() -> dict:
        """The served model, then its LoRA adapters (`parent`: the served model, as vLLM;
        `root`: the adapter's name, no server paths)."""
        try:
            adapters = await coord.list_lora_adapters.remote()
        except Exception as e:
            raise translate(e) from None
        card = {"object": "model", "created": 0, "owned_by": "raygraph",
                "max_model_len": front.max_model_len}
        return {"object": "list", "data": [
            {"id": front.name, "root": front.name, "parent": None, **card},
            *({"id": a["name"], "root": a["name"], "parent": front.name, **card}
              for a in adapters)]}

    @get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        """One of /v1/models' entries (OpenAI's retrieve); 404 for a name it does not list."""
        for card in (await models())["data"]:
            if card["id"] == model:
                return card
        raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora = front.adapter(body.model)
        name = lora or front.name
        prompts = await front.tokenize(front.encode, body.prompt)
        fields = {**body.params(body.max_tokens, body.logprobs), "lora": lora}
        choices = await front.request(prompts, fields, body.n, body.given_max_tokens)
        rid, kind = new_id("cmpl"), "text_completion"
        prompt_tokens = sum(len(p) for p in prompts)
        want_lp = body.logprobs is not None
        if not body.stream:
            results = await front.generate(choices, request.receive)
            lps = await front.result_logprobs(results, front.logprobs.completion
                                              if want_lp else None)
            out = [{"index": i, "text": r.text or "", "logprobs": lp, **ending(r)}
                   for i, (r, lp) in enumerate(zip(results, lps))]
            n = sum(len(r.token_ids) for r in results)
            return JSONResponse(envelope(kind, rid, name, out, usage(prompt_tokens, n)))
        deltas = await front.open_streams(choices)

        async def events() -> AsyncIterator[bytes]:
            offsets: dict[int, int] = {}
            n = 0
            async for i, d in deltas:
                n += len(d.token_ids)
                lp = None
                if want_lp:
                    lp = front.logprobs.completion(d.token_ids, d.logprobs or [],
                                                   offsets.get(i, 0))
                    offsets[i] = offsets.get(i, 0) + sum(len(t) for t in lp["tokens"])
                choice = {"index": i, "text": d.text or "", "logprobs": lp, **ending(d)}
                yield sse(envelope(kind, rid, name, [choice], None, body.include_usage))
            if body.include_usage:
                yield sse(envelope(kind, rid, name, [], usage(prompt_tokens, n)))
            yield sse("[DONE]")

        return StreamingResponse(_guard(events(), deltas), media_type="text/event-stream")

    async def start_chat(body: ChatRequest) -> tuple[str, list[int], list[Choice]]:
        """A chat request's model name, prompt (the template with its tools) and choices."""
        lora = front.adapter(body.model)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] \
            if body.tools_active else None
        render = functools.partial(front.render, tools=tools, kwargs=body.chat_template_kwargs)
        (prompt,) = await front.tokenize(render, [m.text() for m in body.messages],
                                         template_size(tools, body.chat_template_kwargs))
        top = body.top_logprobs or 0
        max_tokens = body.given_max_tokens or front.max_model_len
        fields = {**body.params(max_tokens, top if body.logprobs else None), "lora": lora}
        forced = body.forced_tools()
        if forced is not None:  # the calls, in the model's format, always parse
            grammar = front.tool_format.grammar(forced, body.parallel_tool_calls)
            fields["structured"] = {"kind": "grammar", "value": grammar}
        if fields.get("structured") is not None and front.cfg.reasoning_parser:
            await front.check_structured(fields["structured"])  # the format's own errors
            fields["structured"] = after_reasoning(fields["structured"],
                                                   front.cfg.reasoning_parser, forced is not None)
        choices = await front.request([prompt], fields, body.n, body.given_max_tokens)
        return lora or front.name, prompt, choices

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        name, prompt, choices = await start_chat(body)
        reasoning = front.cfg.reasoning_parser
        tools = front.tool_calls(body)
        rid, kind = new_id("chatcmpl"), "chat.completion"
        if not body.stream:
            results = await front.generate(choices, request.receive)
            lps = await front.result_logprobs(results, front.logprobs.chat
                                              if body.logprobs else None)
            out = [{"index": i, **answer(r, reasoning, tools), "logprobs": lp}
                   for i, (r, lp) in enumerate(zip(results, lps))]
            n = sum(len(r.token_ids) for r in results)
            return JSONResponse(envelope(kind, rid, name, out, usage(len(prompt), n)))
        deltas = await front.open_streams(choices)
        kind = "chat.completion.chunk"

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(choices)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None, "stop_reason": None}
                yield sse(envelope(kind, rid, name, [first], None, body.include_usage))
            n = 0
            split = reasoning is not None or tools is not None
            parts = {i: AnswerStream(reasoning, tools)
                     for i in range(len(choices))} if split else None
            async for i, d in deltas:
                n += len(d.token_ids)
                lp = front.logprobs.chat(d.token_ids, d.logprobs or []) if body.logprobs \
                    else None
                for choice in chat_chunks(i, d, lp, parts[i] if parts else None):
                    yield sse(envelope(kind, rid, name, [choice], None, body.include_usage))
            if body.include_usage:
                yield sse(envelope(kind, rid, name, [], usage(len(prompt), n)))
            yield sse("[DONE]")

        return StreamingResponse(_guard(events(), deltas), media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        chat = body.chat
        name, prompt, choices = await start_chat(chat)
        reasoning, rid = front.cfg.reasoning_parser, new_item_id("resp")
        tools = front.tool_calls(chat)

        def response(items: list[dict], n: int, finish: str | None) -> dict:
            status = "incomplete" if finish == "length" else \
                "completed" if finish else "in_progress"
            return response_object(body, rid, name, items, len(prompt), n, status)

        if not body.stream:
            (r,) = await front.generate(choices, request.receive)
            message = answer(r, reasoning, tools)["message"]
            return JSONResponse(response(output_items(message), len(r.token_ids),
                                         r.finish_reason))
        deltas = await front.open_streams(choices)
        out, sent = ResponseEvents(), [0]  # the events so far, the tokens they carried

        async def events() -> AsyncIterator[bytes]:
            parts, finish = AnswerStream(reasoning, tools), None
            for kind in ("response.created", "response.in_progress"):
                yield event(out.event(kind, response=response([], 0, None)))
            async for _, d in deltas:
                sent[0] += len(d.token_ids)
                pieces = parts.feed(d.text or "")
                if d.finish_reason is not None:
                    pieces += parts.finish()
                    finish = d.finish_reason
                for e in out.feed(pieces):
                    yield event(e)
            for e in out.close():
                yield event(e)
            done = "response.incomplete" if finish == "length" else "response.completed"
            yield event(out.event(done, response=response(out.items, sent[0], finish)))

        def failed(err: ApiError) -> list[bytes]:
            """Responses' own ending: `error`, then `response.failed` (only the `error`
            event when the response object itself is what failed to build)."""
            code = err.code or err.type
            try:
                evs = out.failed(response(out.items, sent[0], None), code, err.message,
                                 err.param)
            except Exception:
                evs = [out.event("error", code=code, message=err.message, param=err.param)]
            return [event(e) for e in evs]

        return StreamingResponse(_guard(events(), deltas, failed),
                                 media_type="text/event-stream")

    @get("/is_sleeping")
    async def is_sleeping() -> dict:
        try:
            return {"is_sleeping": await coord.is_sleeping.remote()}
        except Exception as e:
            raise translate(e) from None

    if cfg.enable_sleep_routes:
        add_sleep_routes(app, coord)
    if cfg.enable_lora_updates:
        add_lora_routes(app, coord)
    return app


def add_sleep_routes(app: FastAPI, coord: Any) -> None:
    """Operator routes that stop serving (`--enable-sleep-routes`; else 404)."""

    @app.post("/sleep")
    async def sleep(level: int = 1, wait: bool = True) -> dict:
        if level not in (1, 2):
            raise ApiError(400, f"level must be 1 or 2, got {level}", "level")
        try:
            return await coord.sleep.remote(level, wait)
        except Exception as e:
            raise translate(e) from None

    @app.post("/wake_up")
    async def wake_up() -> dict:
        try:
            return await coord.wake_up.remote()
        except Exception as e:
            raise translate(e) from None


def add_lora_routes(app: FastAPI, coord: Any) -> None:
    """vLLM's routes that change the served adapters (`--enable-lora-updates`; else 404)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> dict:
        """Register a PEFT adapter under a name (400 with the reason)."""
        try:
            return await coord.load_lora_adapter.remote(body.lora_name, body.lora_path)
        except Exception as e:
            raise translate(e) from None

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> dict:
        try:
            await coord.unload_lora_adapter.remote(body.lora_name)
        except Exception as e:
            raise translate(e) from None
        return {"lora_name": body.lora_name, "unloaded": True}


def template_size(tools: list | None, kwargs: dict | None) -> int:
    """The characters a chat template writes out of a request's tools and kwargs (deeper
    than Python's stack: as many as a long prompt, to the bulk lane)."""
    if not (tools or kwargs):
        return 0
    try:
        return len(json.dumps([tools, kwargs]))
    except (RecursionError, TypeError, ValueError):
        return BULK_CHARS


def _chat_failed(err: ApiError) -> list[bytes]:
    """How a completions or chat stream ends after its 200: an error event, then [DONE]."""
    return [sse(err.body()), sse("[DONE]")]


async def _guard(events: AsyncIterator[bytes], deltas: Merged,
                 failed: Callable[[ApiError], list[bytes]] = _chat_failed
                 ) -> AsyncIterator[bytes]:
    """A stream that fails after its 200 ends as its API ends one (`failed`: OpenAI's error
    event and [DONE], or the Responses API's own events), wherever it failed, its first
    event included; however it ends, its engine streams stop (one that failed before it
    read them too)."""
    try:
        async for e in events:
            yield e
    except Exception as e:
        for b in failed(translate(e)):
            yield b
    finally:
        await deltas.aclose()
