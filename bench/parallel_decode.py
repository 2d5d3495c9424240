"""Decode step latency on several GPUs: graphs vs eager under TP, or attention DP x MoE EP
(Ray actors, NCCL), plus the time and graph count of the lockstep capture schedule.

    python -m bench.parallel_decode --tp 2 [--preset llama-1b] [--batches 1 8 32]
    python -m bench.parallel_decode --tp 1 --dp 2 --ep 2 --preset mixtral-1b
    python -m bench.parallel_decode --tp 4 --preset llama3-8b --load-format dummy --batches 1 \
        --profile

Every DP group gets the same decode batch (balanced load). Each rank runs its plans back to
back (`Worker.time_steps`: input prep, replay or eager forward, sampling, a host read); the
figure is rank 0's median. `--profile`: graphs only, then each rank's GPU time per kernel
name over the timed steps (torch.profiler in the actor), beside its wall time a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray

from bench.checkpoints import add_weight_flags, bench_model
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


class ProfiledWorker(Worker):
    """A Worker whose timed steps can run under torch.profiler (this benchmark only)."""

    def profile_steps(self, plans: list[StepPlan]) -> dict:
        import torch

        from bench.decode_profile import kernel_summary

        self.time_steps(plans[:5])  # warm: the first steps after a capture are slower
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            times = self.time_steps(plans[5:])
        return {"rank": self.rank, "step_ms": round(1e3 * statistics.median(times), 3),
                **kernel_summary(prof, len(plans) - 5, top=12)}


def start(model: str, par: ParallelConfig, mode: str, max_batch: int, context: int, bs: int,
          a: argparse.Namespace):
    """The ranks' Worker actors, loaded (weights as `a`'s weight flags say), and the buckets."""
    blocks = max_batch * -(-(context + 1) // bs)
    cfg = ServeConfig(
        model=model, device="cuda", dtype="bfloat16", parallel=par, load_format=a.load_format,
        quantization=a.quantization,
        cache=CacheConfig(block_size=bs, num_blocks=blocks, cache_dtype=a.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=512,
                                  max_model_len=max(context + 64, 512)),
        graph=GraphConfig(mode=mode, capture="at_start"),
    )
    actor = ray.remote(ProfiledWorker).options(num_gpus=1, num_cpus=1)
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


def plans_of(buckets: BucketPlan | None, ep: bool, batch: int, context: int, bs: int,
             iters: int) -> list[StepPlan]:
    shape = (batch, batch, True)
    comm = 0
    if ep:
        comm = buckets.comm_tokens([shape]) if buckets else batch
    plans = []
    for i in range(iters + 5):
        p = decode_plan(batch, context, bs, i)
        key = buckets.key(*shape, comm) if buckets else None
        plans.append(StepPlan(p.step_id, p.seqs, key=key, num_comm_tokens=comm))
    return plans


def step_ms(workers, plans: list[StepPlan]) -> float:
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
    add_weight_flags(p)
    p.add_argument("--profile", action="store_true",
                   help="graphs only: each rank's kernel times over the timed steps")
    a = p.parse_args()
    bs = 16
    model = bench_model(a.preset, a.load_format)
    connect(None)
    par = ParallelConfig(tp=a.tp, dp=a.dp, ep=a.ep)
    layout = f"tp{a.tp} dp{a.dp} ep{a.ep}"
    rows: dict[int, dict] = {b: {"layout": layout, "batch": b, "context": a.context}
                             for b in a.batches}
    for mode in ("graph",) if a.profile else ("graph", "eager"):
        workers, buckets = start(model, par, mode, max(a.batches), a.context, bs, a)
        if mode == "graph":
            secs, keys, graphs = (capture(workers, buckets))
            print(json.dumps({"layout": layout, "lockstep_capture_s": round(secs, 2),
                              "keys": keys, "graphs": graphs}), flush=True)
        for b in a.batches:
            plans = plans_of(buckets if mode == "graph" else None, a.ep > 1, b, a.context, bs,
                             a.iters)
            if a.profile:
                for r in ray.get([w.profile_steps.remote(plans) for w in workers]):
                    print(json.dumps({"layout": layout, "batch": b, **r}), flush=True)
                continue
            rows[b][f"{mode}_ms"] = round(step_ms(workers, plans), 3)
        for w in workers:
            ray.kill(w)
    if a.profile:
        return
    print("| layout | batch | context | eager ms | graph ms | graph vs eager |")
    print("|---|---|---|---|---|---|")
    for r in rows.values():
        print(json.dumps(r), flush=True)
        print(f"| {r['layout']} | {r['batch']} | {r['context']} | {r['eager_ms']} | "
              f"{r['graph_ms']} | {r['eager_ms'] / r['graph_ms']:.2f}x |")


if __name__ == "__main__":
    main()
