"""The errors a request can meet, as every front door sees them (the HTTP API maps each to a
status; the CLI prints it in one line). A leaf module: every layer may raise them."""

from __future__ import annotations


class BadRequest(ValueError):
    """The request cannot be served as given; nothing was scheduled."""


class WorkerFailure(RuntimeError):
    """A worker died or failed a step; the requests in flight were failed with this."""


class Asleep(RuntimeError):
    """The workers sleep (or are about to): nothing was scheduled; wake them up first."""


class Busy(RuntimeError):
    """Requests are in flight and the caller asked not to wait for them (sleep)."""


class LoRAError(ValueError):
    """An adapter raygraph cannot serve, with its path and the reason."""


class UnknownAdapter(BadRequest, LoRAError):
    """A request named an adapter that is not registered (HTTP: 404 model_not_found)."""


def failure(msg: str, bad_request: bool) -> Exception:
    """The error a request that ended with `msg` raises: BadRequest where it was the
    request's own doing (its grammar failed), else WorkerFailure."""
    return BadRequest(msg) if bad_request else WorkerFailure(msg)


def last_line(err: BaseException) -> str:
    """Ray wraps remote errors in long tracebacks; the cause's last line says what happened."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else repr(err)
