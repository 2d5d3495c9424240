"""Decode step latency on several GPUs: graphs vs eager under TP, or attention DP x MoE EP
(Ray actors, NCCL), plus the time and graph count of the lockstep capture schedule.

    python -m bench.parallel_decode --tp 2 [--preset llama-1b] [--batches 1 8 32]
    python -m bench.parallel_decode --tp 1 --dp 2 --ep 2 --preset mixtral-1b

Every DP group gets the same decode batch (balanced load). Each rank runs its plans back to
back (`Worker.time_steps`: input prep, replay or eager forward, sampling, a host read); the
figure is rank 0's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray

from bench.checkpoints import make_random_checkpoint
from bench.decode_step import decode_plan
from raygraph.client.connect import connect
from raygraph.config import (
    CacheConfig,
    GraphConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.engine.lockstep import LockstepCapture, remote_call_all
from raygraph.graph.buckets import BucketPlan
from raygraph.protocol import StepPlan
from raygraph.worker.worker import Worker


def start(model: str, par: ParallelConfig, mode: str, max_batch: int, context: int, bs: int):
    blocks = max_batch * -(-(context + 1) // bs)
    cfg = ServeConfig(
        model=model, device="cuda", dtype="bfloat16", parallel=par,
        cache=CacheConfig(block_size=bs, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=512,
                                  max_model_len=max(context + 64, 512)),
        graph=GraphConfig(mode=mode, capture="at_start"),
    )
    actor = ray.remote(Worker).options(num_gpus=1, num_cpus=1)
    workers = [actor.remote(cfg, r) for r in range(par.world_size)]
    addr = ray.get(workers[0].address.remote())
    ray.get([w.load.remote(addr) for w in workers])
    ray.get([w.allocate_kv_cache.remote(blocks) for w in workers])
    s = cfg.scheduler
    return workers, BucketPlan.from_config(cfg.graph, s.max_num_seqs, s.max_num_batched_tokens,
                                           par.ep > 1)


def capture(workers, buckets: BucketPlan) -> tuple[float, int, int]:
    lock = LockstepCapture(len(workers))
    t0 = time.perf_counter()
    for key in buckets.schedule():
        lock.capture(key, remote_call_all(workers, timeout=600))
    return (time.perf_counter() - t0, len(lock.reports), sum(r.pieces for r in lock.reports))


def step_ms(workers, buckets: BucketPlan | None, ep: bool, batch: int, context: int, bs: int,
            iters: int) -> float:
    shape = (batch, batch, True)
    comm = 0
    if ep:
        comm = buckets.comm_tokens([shape]) if buckets else batch
    plans = []
    for i in range(iters + 5):
        p = decode_plan(batch, context, bs, i)
        key = buckets.key(*shape, comm) if buckets else None
        plans.append(StepPlan(p.step_id, p.seqs, key=key, num_comm_tokens=comm))
    times = ray.get([w.time_steps.remote(plans) for w in workers])[0][5:]
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    bs = 16
    model = str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
    connect(None)
    par = ParallelConfig(tp=a.tp, dp=a.dp, ep=a.ep)
    layout = f"tp{a.tp} dp{a.dp} ep{a.ep}"
    rows: dict[int, dict] = {b: {"layout": layout, "batch": b, "context": a.context}
                             for b in a.batches}
    for mode in ("graph", "eager"):
        workers, buckets = start(model, par, mode, max(a.batches), a.context, bs)
        if mode == "graph":
            secs, keys, graphs = (capture(workers, buckets))
            print(json.dumps({"layout": layout, "lockstep_capture_s": round(secs, 2),
                              "keys": keys, "graphs": graphs}), flush=True)
        for b in a.batches:
            rows[b][f"{mode}_ms"] = round(step_ms(workers, buckets if mode == "graph" else None,
                                                  a.ep > 1, b, a.context, bs, a.iters), 3)
        for w in workers:
            ray.kill(w)
    print("| layout | batch | context | eager ms | graph ms | graph vs eager |")
    print("|---|---|---|---|---|---|")
    for r in rows.values():
        print(json.dumps(r), flush=True)
        print(f"| {r['layout']} | {r['batch']} | {r['context']} | {r['eager_ms']} | "
              f"{r['graph_ms']} | {r['eager_ms'] / r['graph_ms']:.2f}x |")


if __name__ == "__main__":
    main()
