"""Client side of the coordinator's multiplexed streams, for any process that serves many
streams at once (an HTTP replica, the load benchmark)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgspec

from raygraph.client.requests import pack_ids, take_deltas
from raygraph.engine.lockstep import last_line
from raygraph.errors import WorkerFailure
from raygraph.protocol import SamplingParams, StreamDelta


class StreamHub:
    """This replica's streams over one coordinator subscription (`Coordinator.subscribe`):
    one Ray message per batch of deltas, demultiplexed here into a queue per request. A Ray
    stream per request cost ~0.2 ms a message on each side and capped 64 streams."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord
        self.name = f"http-{secrets.token_hex(6)}"
        # open requests: from open() until their last delta is taken or they are cancelled
        self.queues: dict[int, asyncio.Queue[StreamDelta]] = {}
        self._ended: set[int] = set()  # open, and their last delta is queued
        # cancelled while running: their deltas still in flight are dropped until the last
        self._cancelled: set[int] = set()
        self._pump_task: asyncio.Task | None = None
        # opens not sent yet, and the task sending them: one call per burst (submit_streams)
        self._opening: list[tuple[list[int], SamplingParams, asyncio.Future[int]]] = []
        self._open_task: asyncio.Task | None = None

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
                        if delta.finish_reason is not None:
                            self._ended.add(rid)
                    elif delta.finish_reason is not None:
                        self._cancelled.discard(rid)
        except Exception as e:  # the coordinator is gone: every open stream ends with it
            why = f"the stream subscription failed: {last_line(e)}"
        for rid, q in self.queues.items():
            q.put_nowait(StreamDelta(rid, [], None, "error", error=why))

    async def open(self, prompt: list[int], params: SamplingParams) -> int:
        """Start a stream; its request id. Opens made while a call is on its way go together
        in the next one: a burst of arrivals costs a Ray call or two, not one each, and
        reaches the scheduler at once instead of trickling in over many steps."""
        loop = asyncio.get_running_loop()
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = loop.create_task(self._pump())
        fut: asyncio.Future[int] = loop.create_future()
        self._opening.append((prompt, params, fut))
        if self._open_task is None or self._open_task.done():
            self._open_task = loop.create_task(self._send_opens())
        return await fut

    async def _send_opens(self) -> None:
        while self._opening:
            batch, self._opening = self._opening, []
            try:
                results = await self.coord.submit_streams.remote(
                    self.name, [(pack_ids(prompt), params) for prompt, params, _ in batch])
            except Exception as e:  # the call itself failed: every open in it fails
                results = [e] * len(batch)
            for (_, _, fut), r in zip(batch, results):
                if isinstance(r, BaseException):
                    if not fut.done():
                        fut.set_exception(r)
                    continue
                self._queue(r)  # open from now: a cancel before the first delta is known
                if fut.done():  # its caller went away while the call was out
                    self.cancel([r])
                else:
                    fut.set_result(r)

    async def next(self, request_id: int) -> StreamDelta:
        """The request's deltas queued so far, as one (WorkerFailure if it failed: tokens
        that came before the failure are returned first, the error on the next call)."""
        q = self._queue(request_id)
        delta = take_deltas(q, await q.get())
        if delta.finish_reason == "error" and delta.token_ids:
            q.put_nowait(StreamDelta(request_id, [], None, "error", error=delta.error))
            return msgspec.structs.replace(delta, finish_reason=None, timing=None,
                                           stop_reason=None, error=None)
        if delta.finish_reason is not None:
            self.queues.pop(request_id, None)
            self._ended.discard(request_id)
        if delta.finish_reason == "error":
            raise WorkerFailure(delta.error or "the request failed")
        return delta

    def cancel(self, request_ids: list[int]) -> None:
        """Stop requests whose client went away (the coordinator ends each with "abort")."""
        running = []
        for rid in request_ids:
            if self.queues.pop(rid, None) is None:
                continue  # its last delta was taken already (or it is not ours)
            if rid in self._ended:  # finished, its last delta unread: nothing more comes
                self._ended.discard(rid)
                continue
            running.append(rid)
        self._cancelled.update(running)
        if running:
            self.coord.cancel.remote(running)
