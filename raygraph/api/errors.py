"""OpenAI's error body, and the coordinator's exceptions mapped to HTTP statuses."""

from __future__ import annotations

from fastapi.responses import JSONResponse


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


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def translate(err: BaseException) -> ApiError:
    """An ApiError for what a coordinator call raised (through Ray's wrappers): 404 for an
    unknown model (LoRA adapter), 400 for a bad request or adapter, 503 while not serving,
    asleep or gone, 409 when busy, else 500."""
    from ray.exceptions import RayActorError, RayTaskError

    from raygraph.cluster.connect import first_line
    from raygraph.cluster.lora import UnknownAdapter
    from raygraph.cluster.requests import Asleep, BadRequest, Busy, WorkerFailure
    from raygraph.lora import LoRAError

    if isinstance(err, ApiError):
        return err
    while isinstance(err, RayTaskError) and err.cause is not None and err.cause is not err:
        err = err.cause
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
