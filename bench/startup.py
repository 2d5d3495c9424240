"""Start-up: how soon a fresh coordinator serves, and how it serves while the capture
schedule runs in the background.

    python -m bench.startup [--preset llama-1b] [--capture background at_start]
                            [--streams 64] [--seconds 20]

Per capture mode, one fresh coordinator: seconds from the start call until rank 0's weights
were loaded, until `start()` returned, until the first token of a request sent at that
moment, and until the schedule was complete. From the moment it serves, `--streams` clients
each send one request after another (`--input-len` random tokens, `--output-len` out, over
the multiplexed subscription the HTTP server uses), and output tok/s is reported for the
time the background capture was still running and for the time after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path

import ray

from bench import load
from bench.checkpoints import make_random_checkpoint
from raygraph.client.connect import connect, start_coordinator
from raygraph.config import GraphConfig, ServeConfig
from raygraph.protocol import SamplingParams


def _watch_load(name: str, namespace: str, t0: float, out: dict, stop: threading.Event) -> None:
    """Poll the coordinator's start-up progress: when rank 0's weights were all loaded."""
    while not stop.is_set() and "weights_loaded_s" not in out:
        try:
            done, total = ray.get(ray.get_actor(name, namespace).progress.remote()).load
            if total and done == total:
                out["weights_loaded_s"] = time.perf_counter() - t0
        except ValueError:  # not created yet
            pass
        time.sleep(0.02)


async def _serve_load(coord, a: argparse.Namespace, t_ready: float) -> dict:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
    client = load.mux_client(coord)
    tokens: list[float] = []  # arrival time of every output token
    first: list[float] = []
    end = t_ready + a.seconds
    progress: dict = {}

    async def stream_forever() -> None:
        while time.perf_counter() < end:
            prompt = [rng.randrange(3, 256) for _ in range(a.input_len)]
            async for chunk in client(prompt, params):
                if not first:
                    first.append(chunk.time)
                tokens.extend([chunk.time] * chunk.tokens)

    async def watch_capture() -> None:
        while time.perf_counter() < end:
            p = await coord.capture_progress.remote()
            if p["done"] and "done_at" not in progress:
                progress.update(p, done_at=time.perf_counter())
            await asyncio.sleep(0.05)

    await asyncio.gather(*(stream_forever() for _ in range(a.streams)), watch_capture())
    done_at = progress.get("done_at", end)
    during = [t for t in tokens if t < done_at]
    after = [t for t in tokens if t >= done_at]
    rate_during = len(during) / max(done_at - t_ready, 1e-9)
    rate_after = len(after) / max(time.perf_counter() - done_at, 1e-9) \
        if after and progress else None  # None: the schedule did not complete in time
    return {
        "first_token_after_ready_s": round(first[0] - t_ready, 3) if first else None,
        "schedule_done_after_ready_s": round(done_at - t_ready, 3) if progress else None,
        "keys": progress.get("total"), "eager_steps": progress.get("eager_steps"),
        "capture_s": progress.get("seconds"),
        "tok_s_during_capture": round(rate_during),
        "tok_s_after": round(rate_after) if rate_after else None,
        "during_over_after": round(rate_during / rate_after, 3) if rate_after else None,
    }


def triton_cache_state() -> str:
    """"warm" if Triton's kernel cache already holds compiled kernels (a restart), "cold" if
    not (the first start on a machine compiles every kernel: seconds)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return "warm" if root.is_dir() and any(root.iterdir()) else "cold"


def run_mode(model: str, mode: str, a: argparse.Namespace) -> dict:
    name = f"startup-{mode}"
    cache = triton_cache_state()
    cfg = ServeConfig(model=model, coordinator_name=name,
                      graph=GraphConfig(capture=mode, decode_cascade=a.decode_cascade))
    marks: dict = {}
    stop = threading.Event()
    t0 = time.perf_counter()
    watcher = threading.Thread(target=_watch_load, args=(name, cfg.namespace, t0, marks, stop))
    watcher.start()
    coord = start_coordinator(cfg)
    t_ready = time.perf_counter()
    stop.set()
    watcher.join()
    try:
        row = asyncio.run(_serve_load(coord, a, t_ready))
    finally:
        ray.get(coord.shutdown.remote())
        ray.kill(coord)
    loaded = marks.get("weights_loaded_s")
    ready = t_ready - t0
    first = row["first_token_after_ready_s"]
    return {"capture": mode, "decode_cascade": a.decode_cascade, "triton_cache": cache,
            "weights_loaded_s": round(loaded, 3) if loaded else None,
            "ready_s": round(ready, 3),
            "first_token_after_weights_s": round(ready + first - loaded, 3)
            if loaded and first is not None else None, **row}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --preset")
    p.add_argument("--capture", nargs="+", default=["background", "at_start"])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-cascade", action=argparse.BooleanOptionalAction, default=True,
                   help="decode buckets of 8+ rows captured with and without the cascade")
    a = p.parse_args()
    model = a.model or str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
    connect(None, num_cpus=4)
    for mode in a.capture:
        print(json.dumps(run_mode(model, mode, a)), flush=True)


if __name__ == "__main__":
    main()
