"""Front doors are supervised: a busy port is refused before start-up, an API server whose
process dies serves again on its port, `raygraph serve` exits non-zero when its coordinator
dies, and a detached coordinator restarts itself."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request

import msgspec
import psutil

from raygraph.client.connect import start_coordinator
from raygraph.config import DEFAULT_MODEL, CacheConfig, ServeConfig
from raygraph.protocol import SamplingParams
from tests.test_cli import RAYGRAPH, one_error_line, raygraph


def test_a_busy_port_is_one_line_exit_2_before_start_up():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        p = raygraph("serve", "--port", str(port))
        took = time.monotonic() - t0
    assert p.returncode == 2
    assert one_error_line(p) == (f"raygraph: error: cannot listen on 127.0.0.1:{port}: "
                                 "Address already in use")
    assert "serving" not in p.stdout
    assert took < 10, took  # no Ray, no model: the CLI's own start-up (~1 s)


def ray_process(parent: psutil.Process, actor: str) -> psutil.Process:
    """The process of a Ray actor started under `parent` (its title is ray::Class...)."""
    for _ in range(100):
        for proc in parent.children(recursive=True):
            try:
                if proc.cmdline()[:1] and proc.cmdline()[0].startswith(f"ray::{actor}"):
                    return proc
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no ray::{actor} process")


def get(url: str, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def test_a_killed_api_server_serves_again_and_a_dead_coordinator_exits_1():
    serve = subprocess.Popen([RAYGRAPH, "serve", "--port", "0"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in serve.stdout:
            if "HTTP server at " in line:
                url = line.split("HTTP server at ")[1].split("/v1")[0]
                break
        assert url is not None, serve.stderr.read()
        assert get(url + "/v1/models") == 200
        parent = psutil.Process(serve.pid)
        http = ray_process(parent, "HttpServer")
        http.kill()  # SIGKILL
        http.wait(10)
        t0 = time.monotonic()
        while True:
            try:
                if get(url + "/v1/models") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() - t0 < 30, "the port did not serve again within 30 s"
            time.sleep(0.2)
        assert serve.poll() is None
        ray_process(parent, "Coordinator").kill()
        _, err = serve.communicate(timeout=60)
        assert serve.returncode == 1
        assert "raygraph: error: the coordinator died" in err
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()


def test_a_detached_coordinator_whose_process_died_starts_itself_again(ray_session):
    cfg = ServeConfig(model=DEFAULT_MODEL, device="cpu", coordinator_name="detached-test",
                      cache=CacheConfig(num_blocks=64), step_timeout_s=30)
    handle = start_coordinator(msgspec.structs.replace(cfg), detached=True)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    try:
        (before,) = ray_session.get(handle.generate.remote(["The import statement"], params))
        pid = ray_session.get(handle.__ray_call__.remote(lambda self: os.getpid()))
        ray_session.kill(handle, no_restart=False)  # as a crash: Ray restarts it
        # ray.kill returns before the process dies: a call sent meanwhile may still meet
        # the old coordinator, healthy
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).wait(30)
        reasons = set()
        t0 = time.monotonic()
        while True:  # the restart loads the model and captures again: past 90 s on two
            # busy cores (the full suite's load), so the bound only guards against a hang
            assert time.monotonic() - t0 < 240, reasons
            try:
                stats = ray_session.get(handle.stats.remote(), timeout=10)
            except Exception as e:  # the call met the dying process, or Ray restarting it
                # (ActorUnavailableError at once: without the pause below, a busy loop here
                # and in Ray's own processes that starves the restart, niced as Ray's
                # workers are)
                reasons.add(type(e).__name__)
            else:
                if stats["healthy"]:
                    break
                reasons.add(stats["reason"])
            time.sleep(0.2)
        (after,) = ray_session.get(handle.generate.remote(["The import statement"], params))
        assert after.token_ids == before.token_ids
        assert "the coordinator's process died; starting it again" in reasons
        assert all(r == "the coordinator's process died; starting it again" or
                   r.endswith("Error") for r in reasons), reasons
    finally:
        ray_session.get(handle.shutdown.remote())
        ray_session.kill(handle)




def test_an_api_server_whose_thread_ends_unasked_takes_its_process_down(monkeypatch):
    """uvicorn's thread ending in a live actor would leave a port that no longer serves
    and an actor Ray never replaces: the watch exits the process (Ray restarts it on its
    port, as above), but not when shutdown() asked the thread to end."""
    import threading

    from raygraph.api import server

    exits: list[int] = []
    monkeypatch.setattr(server.os, "_exit", exits.append)
    srv = object.__new__(server.HttpServer)
    srv._url = "http://127.0.0.1:1"
    for stopping, want in ((False, [1]), (True, [])):
        exits.clear()
        srv.thread = threading.Thread(target=lambda: None)
        srv.thread.start()
        srv.stopping = stopping
        srv.watch()
        assert exits == want
