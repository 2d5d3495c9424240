"""The delta channel (raygraph/channel.py): an engine's deltas reach their subscriber over
TCP in batches, a connection without the secret gets nothing, and a subscriber that goes
away hands its queue back (its streams are aborted)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from raygraph.channel import HEADER, ChannelAddress, DeltaChannel, read_deltas
from raygraph.protocol import StreamDelta


async def started(closed: list[asyncio.Queue]) -> tuple[DeltaChannel, ChannelAddress]:
    channel = DeltaChannel(closed.append)
    return channel, await channel.address("127.0.0.1")


def test_queued_deltas_arrive_in_batches_in_order() -> None:
    async def run() -> None:
        closed: list[asyncio.Queue] = []
        channel, address = await started(closed)
        sink = channel.sink("front")  # a request's deltas may queue before it connects
        for i in range(3):
            sink.put_nowait(StreamDelta(i, [i], "x"))
        frames = read_deltas(address, "front")
        assert [d.request_id for d in await anext(frames)] == [0, 1, 2]  # one frame
        sink.put_nowait(StreamDelta(7, [1, 2], None, "stop", error=None))
        (last,) = await anext(frames)
        assert last == StreamDelta(7, [1, 2], None, "stop")
        assert channel.frames == 2 and not closed
        await frames.aclose()  # the subscriber goes away: the engine gets its queue back
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.01)
        assert closed == [sink] and "front" not in channel.sinks
        channel.close()

    asyncio.run(run())


def test_a_connection_without_the_secret_gets_nothing() -> None:
    async def run() -> None:
        closed: list[asyncio.Queue] = []
        channel, address = await started(closed)
        channel.sink("front").put_nowait(StreamDelta(0, [0], "x"))
        for secret in ("0" * 32, "é" * 32):  # a wrong one, one that is not even ASCII
            wrong = msgspec.structs.replace(address, secret=secret)
            assert [batch async for batch in read_deltas(wrong, "front")] == []  # closed
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(HEADER.pack(1 << 20))  # not a hello: closed without reading it
        assert await reader.read() == b""
        writer.close()
        assert channel.frames == 0 and not closed  # the real subscriber's queue is kept
        assert list(channel.sinks) == ["front"]
        channel.close()

    asyncio.run(run())


def test_the_reader_ends_when_the_engine_closes() -> None:
    async def run() -> None:
        channel, address = await started([])
        frames = read_deltas(address, "front")
        channel.sink("front").put_nowait(StreamDelta(0, [0], "x"))
        assert len(await anext(frames)) == 1
        channel.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(frames), 5)

    asyncio.run(run())
