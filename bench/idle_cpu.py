"""What a served worker costs the host while nothing is asked of it, and what its next
request pays for waking it.

Starts a coordinator, serves a few requests, then: each worker's CPU (share of one core)
over --idle-s seconds of idleness, and the latency of a 1-token request sent right after
another one (hot) or after --idle-s of idleness (woken). Run it on two commits to compare;
bench.serving checks the busy steps.

    python -m bench.idle_cpu [--model DIR | --preset llama-1b] [--tp N] [--device auto|cpu|cuda]
                             [--idle-s 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import psutil
import ray
import torch

from bench.checkpoints import make_random_checkpoint
from raygraph.client.connect import connect, start_coordinator
from raygraph.config import DEFAULT_MODEL, GraphConfig, ParallelConfig, ServeConfig
from raygraph.protocol import SamplingParams


def worker_processes() -> list[psutil.Process]:
    """This driver's Ray workers that host a raygraph Worker (children of the private Ray
    instance it started, named by Ray after the actor class)."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::Worker"):
                procs.append(p)
        except psutil.Error:  # exited meanwhile
            pass
    return procs


def cpu_share(procs: list[psutil.Process], seconds: float) -> list[float]:
    """Each process's CPU time over `seconds` of wall time, as a share of one core."""
    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    before = [cpu(p) for p in procs]
    time.sleep(seconds)
    return [(cpu(p) - b) / seconds for p, b in zip(procs, before)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="random-weight checkpoint (bench/checkpoints.py)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    model = a.model or DEFAULT_MODEL
    if a.preset:
        model = str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
    cfg = ServeConfig(model=model, device=a.device, parallel=ParallelConfig(tp=a.tp),
                      graph=GraphConfig(capture="at_start"))
    connect(None, num_cpus=a.tp + 1, log_to_driver=False)
    coord = start_coordinator(cfg.resolved(torch.cuda.device_count()))

    def one_token() -> float:
        t0 = time.perf_counter()
        ray.get(coord.generate.remote([5, 6, 7], SamplingParams(max_tokens=1)))
        return 1e3 * (time.perf_counter() - t0)

    for _ in range(3):
        ray.get(coord.generate.remote([5, 6, 7], SamplingParams(max_tokens=16, ignore_eos=True)))
    procs = worker_processes()
    time.sleep(1.0)
    idle = cpu_share(procs, a.idle_s)
    hot, woken = [], []
    for _ in range(a.repeats):
        one_token()
        hot.append(one_token())
        time.sleep(a.idle_s)
        woken.append(one_token())
    print(json.dumps({
        "model": model, "device": cfg.resolved(torch.cuda.device_count()).device, "tp": a.tp,
        "idle_cpu_pct_per_worker": [round(100 * s, 1) for s in idle],
        "one_token_ms_hot": round(statistics.median(hot), 2),
        "one_token_ms_after_idle": round(statistics.median(woken), 2),
    }))
    ray.get(coord.shutdown.remote())
    ray.shutdown()


if __name__ == "__main__":
    main()
