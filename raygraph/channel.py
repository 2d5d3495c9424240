"""The delta channel: a TCP connection from an engine to each process that streams requests
from it (an HTTP server, the load benchmark), carrying that process's StreamDeltas in
batches, one msgpack frame per batch. Ray carries the calls (`submit_streams`, `cancel`)
and hands out the channel's address; the tokens take this path because a front receives a
message per engine step from every engine, and a frame costs its reader a tenth of a Ray
streaming item's CPU (bench/RESULTS.md, front door).

`DeltaChannel` is the engine's half and runs on the engine actor's event loop;
`read_deltas` is the reader's, on the subscriber's. The server listens on the node's
address; a connection is served only after its first frame names the channel's secret,
which a subscriber can only have from the engine, over Ray.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
import struct
from collections.abc import AsyncIterator, Callable

import msgspec

from raygraph.protocol import StreamDelta
from raygraph.requests import batches

HEADER = struct.Struct("<I")  # a frame: its payload's length, then the payload
HELLO_BYTES = 4096  # a longer first frame is not a subscriber's
HELLO_TIMEOUT_S = 5.0  # a connection that names no subscriber by then is closed


class ChannelAddress(msgspec.Struct, frozen=True):
    host: str
    port: int
    secret: str


class Hello(msgspec.Struct, frozen=True):
    """A subscriber's first frame."""

    secret: str
    name: str


class DeltaChannel:
    """The engine's side: a queue of deltas per subscriber (its name), each sent to that
    subscriber's connection in batches (one frame per wake-up of the writer, so a busy
    event loop sends fewer, larger frames). When a subscriber's connection closes,
    `on_close` gets its queue (the engine aborts the requests streaming into it)."""

    def __init__(self, on_close: Callable[[asyncio.Queue], None]) -> None:
        self.sinks: dict[str, asyncio.Queue[StreamDelta]] = {}
        self.on_close = on_close
        self.frames = 0  # frames sent, over every subscriber
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # subscribers connected
        self._address: ChannelAddress | None = None
        self._starting = asyncio.Lock()
        self._encoder = msgspec.msgpack.Encoder()

    def sink(self, name: str) -> asyncio.Queue[StreamDelta]:
        """The queue of subscriber `name`'s deltas (made before it connects, if need be)."""
        q = self.sinks.get(name)
        if q is None:
            q = self.sinks[name] = asyncio.Queue()
        return q

    async def address(self, host: str) -> ChannelAddress:
        """Where subscribers connect: listening on `host` from the first call on."""
        async with self._starting:
            if self._address is None:
                self._server = await asyncio.start_server(self._serve, host, 0)
                port = self._server.sockets[0].getsockname()[1]
                self._address = ChannelAddress(host, port, secrets.token_hex(16))
        return self._address

    def close(self) -> None:
        """Stop listening and close every subscriber's connection (their readers end)."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        name = None
        try:
            hello = await asyncio.wait_for(read_frame(reader, HELLO_BYTES), HELLO_TIMEOUT_S)
            hello = msgspec.msgpack.decode(hello, type=Hello)
            if not hmac.compare_digest(hello.secret.encode(), self._address.secret.encode()):
                return
            name = hello.name
            self._writers.add(writer)
            send = asyncio.ensure_future(self._send(self.sink(name), writer))
            closed = asyncio.ensure_future(reader.read())  # b"" when the subscriber closes
            try:
                await asyncio.wait({send, closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (send, closed):
                    task.cancel()
                    if task.done() and not task.cancelled():
                        task.exception()  # a reset connection ends it: nothing to report
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, msgspec.DecodeError,
                ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            self._writers.discard(writer)
            if name is not None:
                self.on_close(self.sinks.pop(name, asyncio.Queue()))

    async def _send(self, sink: asyncio.Queue[StreamDelta], writer: asyncio.StreamWriter
                    ) -> None:
        async for batch in batches(sink):
            payload = self._encoder.encode(batch)
            writer.write(HEADER.pack(len(payload)) + payload)
            self.frames += 1
            await writer.drain()  # a slow reader: deltas queue up and go as one frame


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if limit is not None and size > limit:
        raise ValueError(f"a {size}-byte frame; at most {limit} expected")
    return await reader.readexactly(size)


async def read_deltas(address: ChannelAddress, name: str
                      ) -> AsyncIterator[list[StreamDelta]]:
    """Subscriber `name`'s deltas from an engine's channel, a batch per frame, until the
    engine closes it (or is lost: TCP keepalive notices a peer gone silently in ~10 s)."""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    decoder = msgspec.msgpack.Decoder(list[StreamDelta])
    try:
        hello = msgspec.msgpack.encode(Hello(address.secret, name))
        writer.write(HEADER.pack(len(hello)) + hello)
        while True:
            try:
                frame = await read_frame(reader)
            except asyncio.IncompleteReadError:
                return
            yield decoder.decode(frame)
    finally:
        writer.close()
