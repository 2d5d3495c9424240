"""The HTTP server as a Ray actor: uvicorn on its own thread and event loop, so it lives on
the cluster beside the coordinator (and outlives `raygraph serve --detach`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import ray

from raygraph.api.app import HttpConfig, build_app
from raygraph.process import freeze_heap, setup_logging

log = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, coordinator_name: str, namespace: str, cfg: HttpConfig) -> None:
        """The coordinator is found by name, not passed as a handle: Ray restarts a server
        whose process died with its constructor's arguments, and a handle argument lives in
        the object store of the driver, which a detached service has left."""
        import uvicorn

        setup_logging()
        coord = ray.get_actor(coordinator_name, namespace=namespace)
        self.app = app = build_app(coord, cfg)
        # bind here, not in uvicorn: port 0 then gives the real port, and a port in use is
        # this actor's start-up error rather than a thread's log line
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets of that proto
        # (a response's headers and body go in two writes; Nagle would hold the second)
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if cfg.replicas > 1:  # only then: one server alone still fails on a port in use
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror}") from None
        self.port = sock.getsockname()[1]
        host = cfg.host if cfg.host not in ("0.0.0.0", "::") else ray.util.get_node_ip_address()
        self._url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="raygraph-http", daemon=True)
        self.stopping = False
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self._url} did not start")
            time.sleep(0.01)
        # once serving: a server that never started is this constructor's error (above),
        # which Ray reports, not a process exit it would restart without end
        threading.Thread(target=self.watch, name="raygraph-http-watch", daemon=True).start()
        freeze_heap()  # SSE streams must not wait on a full collection of the app's start-up

    def url(self) -> str:
        """The URL, once the tokenizer is loaded: a first start reports a tokenizer that does
        not load (a restart by Ray calls only __init__, and serves probes while it loads)."""
        self.app.state.front.text_ready()
        return self._url

    def watch(self) -> None:
        """A server thread that ends unasked takes its process with it: Ray then starts this
        actor again (max_restarts) on the same port. A live actor whose port no longer
        serves would otherwise never be replaced."""
        self.thread.join()
        if not self.stopping:
            log.error("the HTTP server on %s stopped: exiting so that Ray starts it again",
                      self._url)
            os._exit(1)

    def shutdown(self) -> None:
        self.stopping = True
        self.server.should_exit = True
        self.thread.join(timeout=10)


def http_actor_name(coordinator_name: str, replica: int = 0) -> str:
    return f"{coordinator_name}-http" + (f"-{replica}" if replica else "")


def start_http(cfg: HttpConfig, coordinator_name: str, namespace: str,
               detached: bool = False, name: str | None = None) -> tuple[list[Any], str]:
    """Start the HTTP actors (cfg.replicas, on one port, named after `name`, by default the
    coordinator's) in front of the named coordinator, on this node (the URL's host is this
    node's), and wait until they listen; returns (their handles, URL). NOTE: keep the
    handles: an actor that is not detached dies with its last handle."""
    import msgspec
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    handles: list[Any] = []

    def start(replica: int, replica_cfg: HttpConfig) -> str:
        # a server whose process dies is started again by Ray, on the same port (the
        # driver picked it: cli.listen_port), while the others keep serving
        opts: dict[str, Any] = {
            "name": http_actor_name(name or coordinator_name, replica), "namespace": namespace,
            "num_cpus": 0, "max_restarts": -1,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        if detached:
            opts["lifetime"] = "detached"
        handles.append(ray.remote(HttpServer).options(**opts).remote(
            coordinator_name, namespace, replica_cfg))
        return ray.get(handles[-1].url.remote())

    try:
        url = start(0, cfg)
        port = int(url.rsplit(":", 1)[1])  # port 0: the others join the one the first got
        for replica in range(1, cfg.replicas):
            start(replica, msgspec.structs.replace(cfg, port=port))
        return handles, url
    except BaseException:
        for h in handles:
            ray.kill(h)
        raise


def stop_http(coordinator_name: str, namespace: str) -> bool:
    """Stop the named HTTP actors if there are any; whether there were."""
    replica = 0
    while True:
        try:
            handle = ray.get_actor(http_actor_name(coordinator_name, replica),
                                   namespace=namespace)
        except ValueError:
            return replica > 0
        try:
            ray.get(handle.shutdown.remote(), timeout=15)
        except Exception:
            pass  # it is killed anyway
        ray.kill(handle)
        replica += 1
