"""An idle server's workers sleep: the compiled graph's loop waits on a doorbell, not by
polling its input channel, once the first request is served."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Any

from ray.exceptions import RayChannelTimeoutError

from bench.idle_cpu import cpu_share, worker_processes
from raygraph.engine.doorbell import SPIN_S, DoorbellChannel
from raygraph.protocol import SamplingParams


def test_idle_workers_sleep_after_serving(ray_session, default_model_coord):
    """Every Worker process under this driver is measured: the shared coordinator's, and
    those of any other coordinator still running."""
    coord = default_model_coord
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    (first,) = ray_session.get(coord.generate.remote([5, 6, 7], params))
    procs = worker_processes()
    assert procs, "no Worker process found under this driver"
    time.sleep(1.0)
    shares = cpu_share(procs, 3.0)
    assert max(shares) < 0.10, f"idle workers use {shares} of a core each"
    # the sleeping workers wake for the next request and answer it alike
    t0 = time.perf_counter()
    (again,) = ray_session.get(coord.generate.remote([5, 6, 7], params))
    assert again.token_ids == first.token_ids
    assert time.perf_counter() - t0 < 5.0


class PollingChannel:
    """Ray's shared-memory channel as a reader meets it: a read polls until a value comes."""

    def __init__(self) -> None:
        self.values: queue.Queue = queue.Queue()

    def ensure_registered_as_reader(self) -> None:
        pass

    def ensure_registered_as_writer(self) -> None:
        pass

    def write(self, value: Any, timeout: float | None = None) -> None:
        self.values.put(value)

    def read(self, timeout: float | None = None) -> Any:
        end = time.monotonic() + (1e9 if timeout is None else timeout)
        while True:
            try:
                return self.values.get_nowait()
            except queue.Empty:
                if time.monotonic() >= end:
                    raise RayChannelTimeoutError("nothing to read") from None


def test_a_reader_sleeps_until_the_bell_rings(ray_session) -> None:
    # in the driver the reader's actor id is None: its bell is under ""
    channel = DoorbellChannel(PollingChannel(), {"": f"\0raygraph-test-{uuid.uuid4().hex}"})
    got: dict[str, Any] = {}

    def reader() -> None:
        cpu = time.thread_time()
        got["value"] = channel.read(timeout=10)
        got["at"], got["cpu"] = time.monotonic(), time.thread_time() - cpu

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.5)
    sent = time.monotonic()
    channel.write("step")
    thread.join(timeout=10)
    assert got["value"] == "step"
    assert got["cpu"] < SPIN_S + 0.05, "the reader polled while it waited"
    assert got["at"] - sent < 0.05
