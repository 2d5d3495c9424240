"""Client side of the coordinator's multiplexed streams, for any process that serves many
streams at once (an HTTP replica, the load benchmark)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from raygraph.cluster.lockstep import last_line
from raygraph.cluster.requests import WorkerFailure, take_deltas
from raygraph.protocol import SamplingParams, StreamDelta


class StreamHub:
    """This replica's streams over one coordinator subscription (`Coordinator.subscribe`):
    one Ray message per batch of deltas, demultiplexed here into a queue per request. A Ray
    stream per request cost ~0.2 ms a message on each side and capped 64 streams."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord
        self.name = f"http-{secrets.token_hex(6)}"
        self.queues: dict[int, asyncio.Queue[StreamDelta]] = {}
        # cancelled here: their deltas still in flight are dropped until their last one
        self._cancelled: set[int] = set()
        self._pump_task: asyncio.Task | None = None

    def _queue(self, request_id: int) -> asyncio.Queue[StreamDelta]:
        return self.queues.setdefault(request_id, asyncio.Queue())

    async def _pump(self) -> None:
        gen = self.coord.subscribe.options(num_returns="streaming").remote(self.name)
        why = "the coordinator closed this replica's stream subscription"
        try:
            async for ref in gen:
                for delta in await ref:
                    rid = delta.request_id
                    if rid not in self._cancelled:
                        self._queue(rid).put_nowait(delta)
                    elif delta.finish_reason is not None:
                        self._cancelled.discard(rid)
        except Exception as e:  # the coordinator is gone: every open stream ends with it
            why = f"the stream subscription failed: {last_line(e)}"
        for rid, q in self.queues.items():
            q.put_nowait(StreamDelta(rid, [], why, "error"))

    async def open(self, prompt: list[int], params: SamplingParams) -> int:
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        return await self.coord.submit_stream.remote(self.name, prompt, params)

    async def next(self, request_id: int) -> StreamDelta:
        """The request's deltas queued so far, as one (WorkerFailure if it failed)."""
        q = self._queue(request_id)
        delta = take_deltas(q, await q.get())
        if delta.finish_reason is not None:
            self.queues.pop(request_id, None)
        if delta.finish_reason == "error":
            raise WorkerFailure(delta.text or "the request failed")
        return delta

    def cancel(self, request_ids: list[int]) -> None:
        """Stop requests whose client went away (the coordinator ends each with "abort")."""
        for rid in request_ids:
            self.queues.pop(rid, None)
        self._cancelled.update(request_ids)
        if request_ids:
            self.coord.cancel.remote(request_ids)
