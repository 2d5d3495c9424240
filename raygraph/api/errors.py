"""OpenAI's error body, and the coordinator's exceptions mapped to HTTP statuses."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def http_error(request: Request, e: HTTPException) -> ApiError:
    """Starlette's and FastAPI's own errors (no route, wrong method, an unreadable body)."""
    if e.status_code == 404:
        return ApiError(404, f"Invalid URL ({request.method} {request.url.path})",
                        code="not_found")
    if e.status_code == 405:
        return ApiError(405, f"Method {request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed")
    return ApiError(e.status_code, str(e.detail))


def first_problem(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's first complaint in one line (`field.path: message`, our validators' own
    words without pydantic's prefix), and the top-level field it is about."""
    err = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    msg = str(err.get("msg")).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


def validation_error(e: RequestValidationError) -> ApiError:
    """pydantic's first complaint as a 400; `param` is the top-level field it is about."""
    errors: list[dict[str, Any]] = list(e.errors())
    if errors and errors[0].get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON: {errors[0].get('msg')}")
    return ApiError(400, *first_problem(errors))


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers has OpenAI's body, never FastAPI's {"detail": ...}."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(http_error(request, e), e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"{type(e).__name__}: {e}", type="server_error"))


def translate(err: BaseException) -> ApiError:
    """An ApiError for what a coordinator call raised (through Ray's wrappers): 404 for an
    unknown model (LoRA adapter), 400 for a bad request or adapter, 503 while not serving,
    asleep or gone, 409 when busy, else 500."""
    from ray.exceptions import RayActorError

    from raygraph.client.connect import first_line, remote_cause
    from raygraph.errors import Asleep, BadRequest, Busy, LoRAError, UnknownAdapter, WorkerFailure

    if isinstance(err, ApiError):
        return err
    err = remote_cause(err)
    msg = first_line(err)
    if isinstance(err, UnknownAdapter):
        return ApiError(404, msg, "model", "model_not_found")
    if isinstance(err, (BadRequest, LoRAError)):
        return ApiError(400, msg)
    if isinstance(err, Asleep):
        return ApiError(503, "asleep; POST /wake_up", code="asleep", type="unavailable")
    if isinstance(err, Busy):
        return ApiError(409, msg, code="busy", type="conflict")
    if isinstance(err, WorkerFailure):
        status = 503 if "not serving" in msg else 500
        return ApiError(status, msg, code="worker_failure", type="server_error")
    if isinstance(err, RayActorError):
        return ApiError(503, f"the coordinator is gone: {msg}", code="unavailable",
                        type="unavailable")
    if isinstance(err, AttributeError):  # a coordinator without this method
        return ApiError(501, msg, type="server_error")
    return ApiError(500, f"{type(err).__name__}: {msg}", type="server_error")
