"""The front door's checks that run before any route: the API key and the body size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware, which buffers and runs the app in a task), so a
refusal is sent from the request's headers alone: a client without the key, or one that
announces too large a body, is answered before a byte of its body is read.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from raygraph.api.errors import ApiError
from raygraph.api.schemas import json_text

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

# probes a load balancer or Prometheus calls without a key; every other route needs it
OPEN_PATHS = frozenset({"/health", "/metrics"})


class BodyTooLarge(Exception):
    """A streamed (chunked) body passed the limit while the app read it."""


def unauthorized() -> ApiError:
    return ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                    code="invalid_api_key", type="authentication_error")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (the server's "
                    "--max-request-bytes)", code="request_too_large")


async def send_error(send: Send, e: ApiError) -> None:
    body = json_text(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k.lower() == name), None)


class FrontDoor:
    """Refuses a request without `Authorization: Bearer <api_key>` (401) on every route but
    OPEN_PATHS, and a body over `max_body_bytes` (413): at once from its Content-Length, or,
    for a chunked body, as soon as what was read passes the limit."""

    def __init__(self, app: Asgi, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    def authorized(self, scope: Scope) -> bool:
        if self.expected is None or scope["path"] in OPEN_PATHS:
            return True
        return secrets.compare_digest(header(scope, b"authorization") or b"", self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.authorized(scope):
            return await send_error(send, unauthorized())
        length = header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await send_error(send, too_large(self.max_body_bytes))
        await LimitedBody(self.app, self.max_body_bytes).run(scope, receive, send)


class LimitedBody:
    """One request whose body is counted as the app reads it: past the limit the read
    raises, and whatever the app answers is replaced by a 413 (if nothing was sent yet)."""

    def __init__(self, app: Asgi, limit: int) -> None:
        self.app, self.limit = app, limit
        self.read = 0
        self.over = False
        self.started = False

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            msg = await receive()
            if msg["type"] == "http.request":
                self.read += len(msg.get("body", b""))
                if self.read > self.limit:
                    self.over = True
                    raise BodyTooLarge
            return msg

        async def guarded(msg: Message) -> None:
            if self.over:
                return  # the app's answer to the failed read: the 413 goes instead
            self.started = True
            await send(msg)

        try:
            await self.app(scope, counted, guarded)
        except BodyTooLarge:
            pass
        if self.over and not self.started:
            await send_error(send, too_large(self.limit))
