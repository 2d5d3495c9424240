"""The driver's side of the cluster: connect to Ray, start or find the named coordinator.

Every entry point (the CLI, deploy/, benchmarks) goes through here, so they all reach a
cluster the same way: with Ray's token authentication where the cluster has it, and with
errors that name the cluster they reached.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raygraph.config import ConfigError, ModelConfig, ServeConfig
from raygraph.model.checkpoint import read_headers
from raygraph.protocol import StartupProgress

# Ray settings of a private instance (a cluster of `ray start` takes them as --system-config).
# Call arguments up to 1 MiB travel inside the call, not through the object store: a burst
# of 64 prompts of 1,088 tokens (278 KB packed) reached the coordinator in 2.2 ms instead of
# 3.3 on a 2-core VM (Ray's default puts arguments over 100 KiB in the store).
# worker_niceness: Ray starts its workers at nice 15 by default, so any busy process on the
# machine outside Ray (a client, a tokenizer, a monitoring agent) would take the CPU from the
# engines' step loops; a server's actors run at normal priority
SYSTEM_CONFIG = {"max_direct_call_object_size": 1 << 20, "worker_niceness": 0}


class ClusterError(RuntimeError):
    """No Ray cluster, or no coordinator on it, where the client looked."""


def auth_token_available() -> bool:
    """Whether this machine holds a Ray auth token (the places Ray itself reads)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
    return Path(path).is_file()


def _enable_token_auth() -> None:
    """Ray (2.52+) turns token auth on for `address="auto"` when a token exists locally, but
    not for an explicit address, nor for `ray job submit`. Apply the same rule to every
    address; a cluster without auth ignores the token. RAY_AUTH_MODE set by hand wins."""
    if "RAY_AUTH_MODE" in os.environ or not auth_token_available():
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def connect(address: str | None, namespace: str = "raygraph", num_cpus: int | None = None,
            log_to_driver: bool = True) -> str:
    """Join the cluster at `address` ("auto": the local one), or start a private instance
    when None (never a `ray start` cluster found on the machine, nor RAY_ADDRESS's).
    Returns the GCS address reached, the one clients pass as --address."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace,
                 log_to_driver=log_to_driver, _system_config=SYSTEM_CONFIG)
    else:
        _reachable(address)
        _enable_token_auth()
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)
        except Exception as e:  # ConnectionError, AuthenticationError, RuntimeError from the GCS
            hint = ""
            if os.environ.get("RAY_AUTH_MODE", "disabled") != "token" or "uthentic" in str(e):
                hint = ("; if the cluster uses token auth, copy the head's ~/.ray/auth_token "
                        "here or set RAY_AUTH_TOKEN")
            where = "a local Ray cluster" if address == "auto" else f"a Ray cluster at {address}"
            raise ClusterError(f"cannot reach {where}: {first_line(e)}{hint}") from None
    return ray.get_runtime_context().gcs_address


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """A GCS address (HOST:PORT) that takes no TCP connection is a ClusterError now: Ray
    would retry it for a minute or more."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, OverflowError) as e:
        raise ClusterError(f"cannot reach a Ray cluster at {address}: {e}") from None


def first_line(err: BaseException) -> str:
    """The message of an error without Ray's traceback."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def remote_cause(err: BaseException) -> BaseException:
    """The error a remote call raised, as its own type and message: Ray's RayTaskError
    wrappers (one per actor the error crossed) removed, their tracebacks with them."""
    from ray.exceptions import RayTaskError

    while isinstance(err, RayTaskError) and err.cause is not None and err.cause is not err:
        err = err.cause
    return err


def get_coordinator(name: str = "raygraph-coordinator", namespace: str = "raygraph") -> Any:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        addr = ray.get_runtime_context().gcs_address
        raise ClusterError(
            f"no coordinator named {name!r} in namespace {namespace!r} on the Ray cluster at "
            f"{addr}: start one with `raygraph serve`, or pass the --address it printed"
        ) from None


def check_startup(cfg: ServeConfig) -> ModelConfig:
    """The checks that need no worker, run in the driver: a bad model path, config.json,
    layout or checkpoint file (damaged, a tensor missing or of the wrong shape or dtype),
    the target's or a draft model's, is reported at once, by name, not as an actor that
    died. Dummy weights read no file but
    config.json."""
    model = cfg.model_cfg()
    cfg.parallel.check_model(model)
    draft = cfg.draft_cfg()  # a draft model that cannot draft for this one
    if cfg.load_format == "dummy":
        return model
    headers = read_headers(cfg.model)  # a damaged file fails before torch is imported
    draft_headers = read_headers(draft.path) if draft is not None else None
    from raygraph.model.loader import check_checkpoint  # torch: not for every client

    check_checkpoint(model, headers)
    if draft is not None:  # the draft model's or EAGLE-3 head's files, as the target's
        check_checkpoint(draft, draft_headers)
    return model


def check_room(cfg: ServeConfig, resources: dict[str, float]) -> None:
    """Refuse in one line a layout the cluster cannot hold (every worker takes a GPU, or a
    CPU on the CPU device), saying how many replicas fit."""
    world, n = cfg.parallel.world_size, cfg.replica.replicas
    unit = "GPU" if cfg.device == "cuda" else "CPU"
    have = resources.get(unit, 0)
    if n * world > have:
        raise ClusterError(f"{n} replica(s) of {world} worker(s) need {n * world} {unit}s; "
                           f"the cluster has {have:g}: {int(have // world)} replica(s) fit")


def start_coordinator(cfg: ServeConfig, detached: bool = False, progress: bool = False) -> Any:
    """Create the named coordinator on the connected cluster and wait until it serves.

    `progress` shows bars for model load and the capture schedule (on a terminal) and
    prints one summary line. A failed start removes the coordinator, so a retry can take
    its name.
    """
    from raygraph.coordinator.coordinator import Coordinator

    cfg = cfg.resolved(ray.cluster_resources().get("GPU", 0))
    check_startup(cfg)
    check_room(cfg, ray.cluster_resources())
    opts: dict[str, Any] = {"name": cfg.coordinator_name, "namespace": cfg.namespace,
                            "num_cpus": 0}
    # on this node, as the HTTP servers are: losing another node loses only its replicas
    # (a detached coordinator may restart elsewhere if this node goes)
    opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=detached)
    if detached:  # nothing watches it: Ray restarts it, and it starts itself again
        opts.update(lifetime="detached", max_restarts=-1)
    try:
        handle = ray.remote(Coordinator).options(**opts).remote(cfg)
    except ValueError as e:  # the name is taken
        raise ClusterError(f"{first_line(e)}: stop it first (`raygraph stop`)") from None
    t0 = time.perf_counter()
    ref = handle.start.remote()
    try:
        info = _wait_with_progress(handle, ref) if progress else ray.get(ref)
    except BaseException:
        ray.kill(handle)
        raise
    if progress:
        print(summary_line(info, time.perf_counter() - t0), flush=True)
    return handle


def summary_line(info: dict, seconds: float) -> str:
    if info.get("capture") == "background" and info["graph_mode"] == "graph":
        graphs = f"serving eagerly while {info['keys_total']} keys are captured in the background"
    elif info["graphs_captured"]:
        graphs = (f"{info['buckets_captured']} buckets captured ({info['graphs_captured']} "
                  f"graphs, {info['graph_pool_bytes'] / 2**20:.1f} MiB graph pool)")
    else:
        graphs = f"{info['graph_mode']} mode, no graphs"
    replicas = f"{info['replicas']} replicas x " if info.get("replicas", 1) > 1 else ""
    return (f"ready in {seconds:.1f}s: {info['model']} on {replicas}{info['tp'] * info['dp']} "
            f"{info['device']} worker(s), {info['dtype']}, "
            f"{sum(info['weight_bytes_per_rank']) / 2**20:.1f} MiB of weights, "
            f"{info['num_kv_blocks']} KV blocks, max_model_len {info['max_model_len']}, {graphs}")


def _wait_with_progress(handle: Any, ref: Any) -> dict:
    """Poll the coordinator's start-up progress and draw it until `ref` is ready."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}
    labels = {"load": "loading weights (rank 0)", "capture": "capture schedule"}
    enabled = sys.stderr.isatty()
    try:
        while True:
            ready, _ = ray.wait([ref], timeout=0.2)
            p: StartupProgress = ray.get(handle.progress.remote())
            for phase, (done, total) in (("load", p.load), ("capture", p.capture)):
                if total and enabled:
                    bar = bars.get(phase)
                    if bar is None:
                        bar = bars[phase] = tqdm(total=total, desc=labels[phase],
                                                 unit="tensor" if phase == "load" else "key",
                                                 leave=True, file=sys.stderr)
                    bar.update(done - bar.n)
            if ready:
                return ray.get(ref)
    finally:
        for bar in bars.values():
            bar.close()


__all__ = ["ClusterError", "ConfigError", "connect", "get_coordinator", "start_coordinator"]
