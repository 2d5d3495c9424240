"""What a busy host does to a server: start-up and request latency of the built-in model on
a private Ray, beside --busy processes that spin outside Ray (a client, a tokenizer, another
job), with Ray's workers at --niceness (Ray's default 15, or 0, raygraph's).

    python -m bench.busy_host [--busy 2] [--niceness 0 15] [--requests 20]

Each niceness runs in a fresh process (a private Ray reads it once, at start), one after
the other, with the same busy processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import time


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))


def serve_once(niceness: int, requests: int) -> dict:
    """In this process: a private Ray at `niceness`, the coordinator's start-up, then
    `requests` 8-token requests one after another."""
    import ray

    from raygraph.client import connect as conn
    from raygraph.client.connect import connect, start_coordinator
    from raygraph.config import DEFAULT_MODEL, CacheConfig, ServeConfig
    from raygraph.protocol import SamplingParams

    conn.SYSTEM_CONFIG = {**conn.SYSTEM_CONFIG, "worker_niceness": niceness}
    t0 = time.perf_counter()
    connect(None, num_cpus=4, log_to_driver=False)
    coord = start_coordinator(ServeConfig(model=DEFAULT_MODEL, device="cpu",
                                          cache=CacheConfig(num_blocks=64)))
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    lat = []
    for _ in range(requests):
        t = time.perf_counter()
        ray.get(coord.generate.remote(["The import statement"], params))
        lat.append(time.perf_counter() - t)
    ray.get(coord.shutdown.remote())
    ray.shutdown()
    return {"niceness": niceness, "start_s": round(start_s, 1),
            "request_ms_median": round(1e3 * statistics.median(lat), 1),
            "request_ms_max": round(1e3 * max(lat), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="spinning processes outside Ray")
    ap.add_argument("--niceness", type=int, nargs="+", default=[0, 15])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(serve_once(args.child, args.requests)))
        return
    hogs = [multiprocessing.Process(target=spin, args=(3600,), daemon=True)
            for _ in range(args.busy)]
    for h in hogs:
        h.start()
    try:
        for nice in args.niceness:
            out = subprocess.run([sys.executable, "-m", "bench.busy_host", "--child", str(nice),
                                  "--requests", str(args.requests)], capture_output=True,
                                 text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"busy": args.busy, **row}), flush=True)
    finally:
        for h in hogs:
            h.terminate()


if __name__ == "__main__":
    main()
