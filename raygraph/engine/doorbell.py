"""The step graph's input channel, with a doorbell: a worker waiting for its next command
polls only briefly, then sleeps until the coordinator rings.

Ray's shared-memory channel waits for a write by polling (`sched_yield` in a loop in
`PlasmaObjectHeader::ReadAcquire`), so every worker of an idle server would burn a core.
Here a reader polls for SPIN_S after its last read, so back-to-back steps pay no wake-up,
then blocks on a Unix datagram socket of its own. The writer rings after a write only when
its previous write began at least SPIN_S / 2 earlier: a reader blocks only SPIN_S after its
last read, which followed that previous write, so a sooner write always finds it polling.
A reader on another node than the writer cannot hear the bell and keeps Ray's polling.
"""

from __future__ import annotations

import logging
import math
import select
import socket
import time
import uuid
from typing import Any

import ray
from ray.exceptions import RayChannelTimeoutError
from ray.experimental.channel.common import ChannelInterface
from ray.experimental.channel.shared_memory_channel import SharedMemoryType
from ray.experimental.channel.utils import get_actor_node

log = logging.getLogger("raygraph.worker")

SPIN_S = 0.01  # how long a reader polls after a read before it sleeps


class DoorbellType(SharedMemoryType):
    """Ray's shared-memory channel type, whose channels come with a doorbell per reader on
    the writer's node (set as the type hint of the graph's input nodes)."""

    def create_channel(self, writer: Any, reader_and_node_list: list[tuple[Any, str]],
                       driver_actor_id: str | None = None) -> DoorbellChannel:
        inner = super().create_channel(writer, reader_and_node_list, driver_actor_id)
        node, tag = get_actor_node(writer), uuid.uuid4().hex
        # abstract socket names: nothing on disk, gone with the process
        bells = {actor._actor_id.hex(): f"\0raygraph-bell-{tag}-{i}"
                 for i, (actor, reader_node) in enumerate(reader_and_node_list)
                 if reader_node == node}
        return DoorbellChannel(inner, bells)


class DoorbellChannel(ChannelInterface):
    """Ray's channel `inner`, plus `bells`: reader actor id -> its socket's name."""

    def __init__(self, inner: ChannelInterface, bells: dict[str, str]) -> None:
        self._inner = inner
        self._bells = bells
        self._sender: socket.socket | None = None  # writer side, made on the first ring
        self._bell: socket.socket | None = None  # reader side: this reader's bound socket
        self._reader_ready = False
        self._last_write = -math.inf  # when the previous write began
        self._last_read = time.monotonic()

    def __reduce__(self) -> tuple[Any, ...]:
        return DoorbellChannel, (self._inner, self._bells)

    def ensure_registered_as_writer(self) -> None:
        self._inner.ensure_registered_as_writer()

    def ensure_registered_as_reader(self) -> None:
        """Bind this reader's socket before its first look at the channel: a ring that
        comes before the bind is lost, but that write is then seen by the look itself."""
        if self._reader_ready:
            return
        self._inner.ensure_registered_as_reader()
        name = self._bells.get(ray.get_runtime_context().get_actor_id() or "")
        if name is not None:
            bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                bell.bind(name)
            except OSError as e:  # this reader keeps Ray's polling
                log.warning("no doorbell for the step graph's input (%s): the worker polls", e)
                bell.close()
            else:
                bell.setblocking(False)
                self._bell = bell
        self._reader_ready = True

    def write(self, value: Any, timeout: float | None = None) -> None:
        start = time.monotonic()
        self._inner.write(value, timeout)
        if time.monotonic() - self._last_write >= SPIN_S / 2:
            self._ring()
        self._last_write = start

    def read(self, timeout: float | None = None) -> Any:
        self.ensure_registered_as_reader()
        if self._bell is None:
            return self._inner.read(timeout)
        now = time.monotonic()
        end = math.inf if timeout is None or timeout < 0 else now + timeout
        while True:
            spin_end = self._last_read + SPIN_S
            try:
                value = self._inner.read(max(0.0, min(spin_end, end) - now))
            except RayChannelTimeoutError:
                now = time.monotonic()
                if now >= end:
                    raise
                if now >= spin_end:
                    select.select([self._bell], [], [], None if end == math.inf else end - now)
                    self._drain()
                    now = time.monotonic()
                continue
            self._last_read = time.monotonic()
            return value

    def close(self) -> None:
        self._inner.close()
        self._ring()  # a sleeping reader wakes and finds the channel closed

    def _ring(self) -> None:
        if self._sender is None:
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sender.setblocking(False)
        for name in self._bells.values():
            try:
                self._sender.sendto(b"\0", name)
            except OSError:  # not bound yet, gone, or rung already (its queue is full)
                pass

    def _drain(self) -> None:
        try:
            while self._bell.recv(64):
                pass
        except BlockingIOError:
            pass
