"""StreamHub's opens (client/streams.py): a burst goes to the coordinator as one call, opens
made while a call is out go in the next, and each open gets its own result or error. The
coordinator here records the calls the hub makes; the real one is in tests/test_http.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from raygraph.channel import DeltaChannel
from raygraph.client.streams import ReplicaStreams, StreamHub
from raygraph.config import ReplicaConfig
from raygraph.errors import BadRequest, WorkerFailure
from raygraph.protocol import ReplicaState, SamplingParams, StreamDelta, replica_of
from raygraph.requests import encode_prompt, pack_ids


class Method:
    def __init__(self, fn: Any) -> None:
        self.remote, self.options = fn, lambda **_: self


class Recorder:
    """The coordinator methods StreamHub calls: each submit_streams call waits for the test to
    answer it (a request id per prompt, or the exception given for that prompt)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[Any], asyncio.Future]] = []
        self.cancelled: list[int] = []
        self.submit_streams = Method(self._submit)
        self.channel = Method(self._channel)
        self.cancel = Method(self.cancelled.extend)

    def _submit(self, name: str, requests: list[tuple[Any, Any]]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.calls.append(([encode_prompt(p, None, 2**20) for p, _ in requests], fut))
        return fut

    async def _channel(self) -> None:
        await asyncio.Event().wait()  # no deltas: these tests only open

    def answer(self, call: int, errors: dict[int, Exception] | None = None) -> None:
        prompts, fut = self.calls[call]
        fut.set_result([(errors or {}).get(p[0], p[0] * 10) for p in prompts])


async def until(cond: Any) -> None:
    for _ in range(100):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the hub did not get there")


def opening(hub: StreamHub, *ids: int) -> list[asyncio.Future]:
    """An open per id (prompt [id]), started now; the recorder answers id * 10."""
    return [asyncio.ensure_future(hub.open([i], SamplingParams(max_tokens=1))) for i in ids]


def test_a_burst_of_opens_is_one_call_and_later_ones_wait_for_the_next() -> None:
    async def run() -> None:
        coord = Recorder()
        hub = StreamHub(coord)
        first = opening(hub, 1, 2, 3)
        await until(lambda: coord.calls)
        assert [p for p, _ in coord.calls] == [[[1], [2], [3]]]
        later = opening(hub, 4, 5)
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(coord.calls) == 1  # one call at a time: these wait for the first's answer
        coord.answer(0, {2: BadRequest("prompt 2 is bad")})
        assert await first[0] == 10 and await first[2] == 30
        with pytest.raises(BadRequest, match="prompt 2 is bad"):
            await first[1]  # only its own open fails
        await until(lambda: len(coord.calls) == 2)
        assert [p for p, _ in coord.calls][1] == [[4], [5]]
        coord.answer(1)
        assert [await f for f in later] == [40, 50]
        assert set(hub.queues) == {10, 30, 40, 50}

    asyncio.run(run())


def test_an_open_whose_caller_left_is_cancelled_once_its_id_is_known() -> None:
    async def run() -> None:
        coord = Recorder()
        hub = StreamHub(coord)
        kept, gone = opening(hub, 1, 2)
        await until(lambda: coord.calls)
        gone.cancel()
        await asyncio.sleep(0)
        coord.answer(0)
        assert await kept == 10
        await until(lambda: coord.cancelled)
        assert coord.cancelled == [20] and set(hub.queues) == {10}

    asyncio.run(run())


def test_a_failed_call_fails_every_open_in_it_and_the_hub_goes_on() -> None:
    async def run() -> None:
        coord = Recorder()
        hub = StreamHub(coord)
        opens = opening(hub, 1, 2)
        await until(lambda: coord.calls)
        coord.calls[0][1].set_exception(RuntimeError("the coordinator is gone"))
        for f in opens:
            with pytest.raises(RuntimeError, match="is gone"):
                await f
        (again,) = opening(hub, 3)
        await until(lambda: len(coord.calls) == 2)
        coord.answer(1)
        assert await again == 30

    asyncio.run(run())


def test_packed_prompts_are_checked_like_lists() -> None:
    ids = [0, 5, 131071, 70000]
    packed = pack_ids(ids)
    assert isinstance(packed, bytes) and len(packed) == 16
    assert encode_prompt(packed, None, 131072) == ids
    with pytest.raises(BadRequest, match=r"token ids \[131071\] are outside"):
        encode_prompt(packed, None, 131071)
    with pytest.raises(BadRequest, match="empty prompt"):
        encode_prompt(pack_ids([]), None, 10)
    with pytest.raises(BadRequest, match="not uint32s"):
        encode_prompt(packed[:7], None, 131072)
    for bad in ([1, -2], [1, 2**40], [1, 2.5]):  # sent as given: the coordinator says why
        assert pack_ids(bad) == bad
        with pytest.raises(BadRequest):
            encode_prompt(bad, None, 10)


def test_a_burst_reaches_the_step_thread_a_step_at_a_time():
    """submit_streams hands registered prompts to the step thread each time a step's worth of
    tokens is registered (the first step starts while the rest register), then the rest;
    a refused prompt is in none of them, and every request is registered before its
    sequences leave."""
    import queue
    import threading
    import types

    from raygraph.config import SchedulerConfig, ServeConfig
    from raygraph.engine.engine import Engine
    from raygraph.engine.sequence import Sequence

    c = object.__new__(Engine)  # the method's own state only: no workers, no model
    c.cfg = ServeConfig(scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    c.recovering, c.subscribers, c.schedulers = False, DeltaChannel(print), [None]  # one DP group
    c.sleeper = types.SimpleNamespace(wake_for_request=lambda: asyncio.sleep(0))  # awake
    c._inbox, c._wake = queue.SimpleQueue(), threading.Event()
    registered: dict[int, types.SimpleNamespace] = {}

    def requests(prompt, params, stream):
        if not prompt:
            raise BadRequest("empty prompt")
        seq = Sequence(len(registered), list(prompt), SamplingParams())
        registered[seq.seq_id] = req = types.SimpleNamespace(seq_id=seq.seq_id, deltas=None)
        return (req,), [(seq, None)]

    def enqueue(seqs):  # as the coordinator's, checking each request is registered first
        assert all(registered[s.seq_id].deltas is c.subscribers.sinks["hub"] for s, _ in seqs)
        Engine._enqueue(c, seqs)

    c._requests, c._enqueue = requests, enqueue
    burst = [[1] * 1088] * 5 + [[]] + [[2] * 64] * 3
    out = asyncio.run(c.submit_streams("hub", [(p, None) for p in burst]))
    assert isinstance(out[5], BadRequest) and out[:5] + out[6:] == list(range(8))
    items = []
    while not c._inbox.empty():
        kind, seqs = c._inbox.get()
        assert kind == "add"
        items.append([s.seq_id for s, _ in seqs])
    assert items == [[0, 1], [2, 3], [4, 5, 6, 7]]  # 2,176 tokens, 2,176, then the rest
    assert c._wake.is_set()
    c.schedulers = [None, None]  # two DP groups: a step's worth for each before the first goes
    asyncio.run(c.submit_streams("hub", [(p, None) for p in burst]))
    items = []
    while not c._inbox.empty():
        items.append([s.seq_id for s, _ in c._inbox.get()[1]])
    assert items == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_sequences_queued_before_a_failure_are_dropped_after_the_restart():
    """A worker group fails while a burst's sequences wait in the inbox: every registered
    request is failed, and those sequences are dropped when the restarted group drains them
    (they would compute for requests already told of the failure). Sequences registered
    after the failure are admitted."""
    import itertools
    import queue
    import threading
    import types

    from raygraph.engine.engine import Engine
    from raygraph.engine.sequence import Sequence

    c = object.__new__(Engine)  # the inbox's own state only: no workers, no model
    c._ids, c._stale_below, c.lora = itertools.count(), 0, None
    c._inbox, c._wake = queue.SimpleQueue(), threading.Event()
    admitted: list[int] = []
    c.healthy, c.sleeper = True, types.SimpleNamespace(asleep=False)
    c.core = types.SimpleNamespace(add=lambda seqs: admitted.extend(s.seq_id for s in seqs))
    failed: list[str] = []
    c.clients = types.SimpleNamespace(fail=failed.append)

    def burst(n: int) -> None:
        Engine._enqueue(c, [(Sequence(next(c._ids), [1, 2], SamplingParams()), None)
                                 for _ in range(n)])

    burst(3)
    burst(2)
    c._fail_in_flight("step 7 failed on a worker")  # as _on_failure schedules it
    burst(2)  # registered after the restart
    assert Engine._drain_inbox(c) is True
    assert failed == ["step 7 failed on a worker"]
    assert admitted == [6, 7]  # ids 0-4 were failed; 5 is the mark itself
    burst(1)
    Engine._drain_inbox(c)
    assert admitted == [6, 7, 8]


class ScriptedEngine:
    """An engine's stream methods over a real delta channel: ids from `first` up; deltas
    sent through `send`; `lose()` closes the channel as a dead engine's process does."""

    def __init__(self, replica: int) -> None:
        self._actor_id = replica
        self.ids = iter(range((replica << 48) + 1, (replica + 1) << 48))
        self.opened: list[int] = []
        self.deltas = DeltaChannel(lambda sink: None)
        self.name = ""
        self.submit_streams = Method(self._submit)
        self.channel = Method(lambda: self.deltas.address("127.0.0.1"))
        self.cancel = Method(lambda rids: None)

    async def _submit(self, name: str, requests: list) -> list[int]:
        self.name = name
        rids = [next(self.ids) for _ in requests]
        self.opened += rids
        return rids

    def send(self, rid: int, tokens: list[int], finish: str | None = None) -> None:
        self.deltas.sink(self.name).put_nowait(StreamDelta(rid, tokens, None, finish))

    def lose(self) -> None:
        self.deltas.close()  # the channel closes: the hub fails its streams


class ScriptedCoordinator:
    def __init__(self, engines: list[ScriptedEngine]) -> None:
        self.states = [ReplicaState(e._actor_id, e, "serving") for e in engines]
        self.replica_states = Method(lambda: asyncio.sleep(0, list(self.states)))


def test_a_stream_lost_before_its_first_token_is_opened_again_on_another_replica():
    async def run() -> None:
        engines = [ScriptedEngine(0), ScriptedEngine(1)]
        streams = ReplicaStreams(ScriptedCoordinator(engines), ReplicaConfig(
            replicas=2, routing="round-robin"), block_size=4, spill_at=8)
        params = SamplingParams(max_tokens=2)
        quiet, started = await streams.open([1, 2], params), await streams.open([3], params)
        assert (replica_of(quiet), replica_of(started)) == (0, 1)
        other = await streams.open([4], params)  # replica 0 again
        engines[0].send(other, [7])
        assert (await streams.next(other)).token_ids == [7]  # it has a token now
        engines[0].lose()
        nxt = asyncio.ensure_future(streams.next(quiet))
        await until(lambda: len(engines[1].opened) == 2)  # opened again on replica 1
        moved = engines[1].opened[-1]
        engines[1].send(moved, [5, 6], "length")
        delta = await nxt
        assert delta.request_id == quiet and delta.token_ids == [5, 6]  # the id it had
        with pytest.raises(WorkerFailure):  # part of its answer was sent: it fails
            await streams.next(other)
        engines[1].send(started, [9], "length")
        assert (await streams.next(started)).token_ids == [9]
        assert streams.unsent == {} and streams.alias == {} and streams.router.load == [0, 0]

    asyncio.run(run())


def test_a_replica_the_coordinator_reports_lost_ends_its_streams_with_the_channel_open():
    """A node lost without a word leaves its channels open until TCP notices; the streams
    on it end (or move, before a token) as soon as the coordinator says the engine is gone."""
    async def run() -> None:
        engines = [ScriptedEngine(0), ScriptedEngine(1)]
        coord = ScriptedCoordinator(engines)
        streams = ReplicaStreams(coord, ReplicaConfig(replicas=2, routing="round-robin"),
                                 block_size=4, spill_at=8)
        params = SamplingParams(max_tokens=2)
        started = await streams.open([1], params)
        quiet = await streams.open([2], params)
        spoken = await streams.open([3], params)
        assert [replica_of(r) for r in (started, quiet, spoken)] == [0, 1, 0]
        engines[0].send(started, [7])
        assert (await streams.next(started)).token_ids == [7]
        coord.states[0] = ReplicaState(0, None, "failed", "its node died")
        await streams._ask()  # the periodic refresh; nothing came over replica 0's channel
        with pytest.raises(WorkerFailure, match="its node died"):
            await asyncio.wait_for(streams.next(started), 5)  # not left hanging
        nxt = asyncio.ensure_future(streams.next(spoken))  # no token yet: opened again
        await until(lambda: len(engines[1].opened) == 2)
        engines[1].send(engines[1].opened[-1], [4], "length")
        assert (await nxt).token_ids == [4]
        engines[1].send(quiet, [5], "length")  # the other replica's streams are untouched
        assert (await streams.next(quiet)).token_ids == [5]

    asyncio.run(run())
