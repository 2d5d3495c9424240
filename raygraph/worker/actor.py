"""The worker's Ray actor class, defined without torch.

Ray needs the class an actor is made from in the process that creates it: the engine. Made
from `Worker`, it would import torch and the model code there (seconds per engine start) only
to name the class. `WorkerActor` names the same calls; its `Worker` is built, and torch
imported, in the worker's own process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raygraph.config import ServeConfig
from raygraph.protocol import WORKER_CALLS

# the actor's methods: start-up, the compiled graph's `run`, and the WorkerCall methods as
# plain actor calls (before the graph is up)
METHODS = ("address", "load", "allocate_kv_cache", "run", *sorted(WORKER_CALLS))


def _forwarded(name: str) -> Callable[..., Any]:
    def method(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class WorkerActor:
    """A Worker as an actor: `ray.remote(WorkerActor)` where the engine starts its workers."""

    def __init__(self, cfg: ServeConfig, rank: int) -> None:
        from raygraph.worker.worker import Worker  # torch: in this actor's process only

        self.worker = Worker(cfg, rank)


for _name in METHODS:
    setattr(WorkerActor, _name, _forwarded(_name))
