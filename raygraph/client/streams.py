"""Client side of the engines' multiplexed streams, for any process that serves many streams
at once (an HTTP server, the load benchmark): one subscription per replica's engine, and a
router that picks the replica of each new stream."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import msgspec

from raygraph.channel import read_deltas
from raygraph.config import ReplicaConfig
from raygraph.coordinator.router import Router
from raygraph.errors import WorkerFailure, failure, last_line
from raygraph.protocol import ROUTES_REFRESH_S, SamplingParams, StreamDelta, replica_of
from raygraph.requests import pack_ids, take_deltas

log = logging.getLogger("raygraph.client")


class StreamHub:
    """This process's streams on one engine: opened with Ray calls, their deltas read from
    the engine's delta channel (raygraph/channel.py) a batch per frame, demultiplexed here
    into a queue per request."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.failed = False  # the channel closed: this engine is gone
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
        """The request's queue, made on first use (setdefault would build one per delta)."""
        q = self.queues.get(request_id)
        if q is None:
            q = self.queues[request_id] = asyncio.Queue()
        return q

    async def _pump(self) -> None:
        why = "the engine closed this process's delta channel"
        try:
            address = await self.engine.channel.remote()
            async for batch in read_deltas(address, self.name):
                for delta in batch:
                    rid = delta.request_id
                    if rid not in self._cancelled:
                        self._queue(rid).put_nowait(delta)
                        if delta.finish_reason is not None:
                            self._ended.add(rid)
                    elif delta.finish_reason is not None:
                        self._cancelled.discard(rid)
        except Exception as e:  # the engine is gone: every open stream ends with it
            why = f"the delta channel failed: {last_line(e)}"
        self._fail(why)

    def _fail(self, why: str) -> None:
        self.failed = True
        for rid, q in self.queues.items():
            q.put_nowait(StreamDelta(rid, [], None, "error", error=why))

    def lost(self, why: str) -> None:
        """The engine is gone (the coordinator says so) though its channel is still open, as
        it is until TCP notices a node lost without a word: its streams end now."""
        if not self.failed:
            if self._pump_task is not None:
                self._pump_task.cancel()
            self._fail(why)

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
                results = await self.engine.submit_streams.remote(
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
            q.put_nowait(StreamDelta(request_id, [], None, "error", error=delta.error,
                                     bad_request=delta.bad_request))
            return msgspec.structs.replace(delta, finish_reason=None, timing=None,
                                           stop_reason=None, error=None)
        if delta.finish_reason is not None:
            self.queues.pop(request_id, None)
            self._ended.discard(request_id)
        if delta.finish_reason == "error":
            raise failure(delta.error or "the request failed", delta.bad_request)
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
            self.engine.cancel.remote(running)


class ReplicaStreams:
    """Streams over every replica: a StreamHub per engine, the replica of each new stream
    picked by a Router. The engines come from the coordinator (`replica_states`), asked
    again at most every REFRESH_S when one is not serving, so a replica started again is
    used once it serves. A request id names its replica (protocol.replica_of).

    A stream whose engine is lost before its first token is opened again on another
    replica (its client has seen nothing of it); it keeps the id it was opened with. One
    lost after a token ends with the error: its client has part of an answer."""

    REFRESH_S = 1.0

    def __init__(self, coord: Any, cfg: ReplicaConfig, block_size: int, spill_at: int) -> None:
        self.coord = coord
        self.router = Router(cfg.replicas, cfg, block_size, spill_at)
        self.hubs: list[StreamHub | None] = [None] * cfg.replicas
        self.costs: dict[int, int] = {}  # open request -> its tokens on the router
        # open streams with no token yet: what to open again if their engine is lost
        self.unsent: dict[int, tuple[list[int], SamplingParams]] = {}
        self.alias: dict[int, int] = {}  # a stream opened again: its first id -> its id now
        for r in range(cfg.replicas):  # none is used before the coordinator names its engine
            self.router.set_up(r, False)
        self._checked = -1e9
        self._all_up = False
        self._asking: asyncio.Task | None = None

    @staticmethod
    def from_info(coord: Any, info: dict) -> ReplicaStreams:
        """Over the coordinator whose `describe()` is `info`."""
        return ReplicaStreams(coord, msgspec.convert(info["replica_config"], ReplicaConfig),
                              info["block_size"], info["spill_at"])

    async def _refresh(self) -> None:
        """Ask the coordinator for the engines when a hub is not fine (at most every
        REFRESH_S; the opens wait for the one call) or every ROUTES_REFRESH_S (replicas come
        and go; then in the background, the open goes on)."""
        fresh = time.monotonic() - self._checked < ROUTES_REFRESH_S
        hubs = self.hubs[:len(self.router.up)]  # past it: replicas scaled away
        healthy = self._all_up and all(h is not None and not h.failed for h in hubs)
        if healthy and fresh:
            return
        for r, hub in enumerate(hubs):
            if hub is not None and hub.failed:  # its engine is gone: no new stream there
                self.router.set_up(r, False)
        if self._asking is None or self._asking.done():
            if (not healthy and time.monotonic() - self._checked < self.REFRESH_S
                    and any(self.router.up)):
                return
            self._asking = asyncio.get_running_loop().create_task(self._ask())
            self._asking.add_done_callback(self._asked)
        if not healthy:
            await asyncio.shield(self._asking)

    def _asked(self, task: asyncio.Task) -> None:
        if self._asking is task:
            self._asking = None
        if not task.cancelled() and task.exception() is not None:  # opens waiting see it
            log.warning("asking the coordinator for the replicas: %s",
                        last_line(task.exception()))

    async def _ask(self) -> None:
        self._checked = time.monotonic()
        states = await self.coord.replica_states.remote()
        if len(states) != len(self.router.up):  # scaled; a removed replica's hub stays
            self.hubs += [None] * (len(states) - len(self.hubs))  # for its open streams
            self.router.resize(len(states))
        for s in states:
            hub = self.hubs[s.replica]
            if hub is not None and s.state in ("failed", "starting") and (
                    s.engine is None or hub.engine._actor_id != s.engine._actor_id):
                hub.lost(f"replica {s.replica} was lost: {s.reason}")
            if s.state != "serving":
                self.router.set_up(s.replica, False)
                continue
            if hub is None or hub.failed or hub.engine._actor_id != s.engine._actor_id:
                self.hubs[s.replica] = StreamHub(s.engine)
            self.router.set_up(s.replica, True)
        self._all_up = all(s.state == "serving" for s in states)

    async def open(self, prompt: list[int], params: SamplingParams) -> int:
        """Start a stream on the replica the router picks; its request id."""
        rid = await self._open(prompt, params)
        self.unsent[rid] = (prompt, params)
        return rid

    async def _open(self, prompt: list[int], params: SamplingParams) -> int:
        await self._refresh()
        cost = len(prompt) + params.max_tokens
        try:
            replica = self.router.pick(prompt, cost, params.lora)
        except ValueError:
            raise WorkerFailure("not serving: no replica serves") from None
        try:
            rid = await self.hubs[replica].open(prompt, params)
        except BaseException:
            self.router.done(replica, cost)
            raise
        self.costs[rid] = cost
        return rid

    def _ended(self, rid: int) -> None:
        cost = self.costs.pop(rid, None)
        if cost is not None:
            self.router.done(replica_of(rid), cost)

    async def next(self, request_id: int) -> StreamDelta:
        """StreamHub.next on the request's replica; opened again elsewhere if that engine
        is lost before the stream's first token."""
        rid = self.alias.get(request_id, request_id)
        hub = self.hubs[replica_of(rid)]
        try:
            delta = await hub.next(rid)
        except WorkerFailure:
            if hub.failed and request_id in self.unsent and await self._resend(request_id, rid):
                return await self.next(request_id)
            self._forget(request_id, rid)
            raise
        except BaseException:
            self._forget(request_id, rid)
            raise
        if delta.token_ids:
            self.unsent.pop(request_id, None)
        if delta.finish_reason is not None:
            self._forget(request_id, rid)
        return delta if rid == request_id else msgspec.structs.replace(
            delta, request_id=request_id)

    async def _resend(self, request_id: int, rid: int) -> bool:
        """Open a stream whose engine was lost again on another replica; False if none
        serves (the stream then ends with its error)."""
        prompt, params = self.unsent[request_id]
        self._ended(rid)
        self.router.set_up(replica_of(rid), False)
        try:
            self.alias[request_id] = await self._open(prompt, params)
        except WorkerFailure:
            return False
        log.warning("replica %d was lost before request %d's first token: sent to replica %d",
                    replica_of(rid), request_id, replica_of(self.alias[request_id]))
        return True

    def _forget(self, request_id: int, rid: int) -> None:
        self._ended(rid)
        self.unsent.pop(request_id, None)
        self.alias.pop(request_id, None)

    def cancel(self, request_ids: list[int]) -> None:
        by_replica: dict[int, list[int]] = {}
        for request_id in request_ids:
            rid = self.alias.get(request_id, request_id)
            self._forget(request_id, rid)
            by_replica.setdefault(replica_of(rid), []).append(rid)
        for replica, rids in by_replica.items():
            hub = self.hubs[replica]
            if hub is not None:
                hub.cancel(rids)
