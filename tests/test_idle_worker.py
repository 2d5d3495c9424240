"""An idle server's workers sleep: the compiled graph's loop waits on a doorbell, not by
polling its input channel, once the first request is served."""

from __future__ import annotations

import time

import pytest

from bench.idle_cpu import cpu_share, worker_processes
from raygraph.cluster.connect import start_coordinator
from raygraph.config import GraphConfig, ServeConfig
from raygraph.protocol import SamplingParams


@pytest.fixture(scope="module")
def coord(ray_session):
    cfg = ServeConfig(device="cpu", graph=GraphConfig(mode="eager"),
                      coordinator_name="idle-test", step_timeout_s=30)
    handle = start_coordinator(cfg)
    yield handle
    ray_session.get(handle.shutdown.remote())
    ray_session.kill(handle)


def test_idle_workers_sleep_after_serving(ray_session, coord):
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
