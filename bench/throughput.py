"""End-to-end throughput: N random-token prompts through the coordinator, tokens/s.

    python -m bench.throughput --num-prompts 64 [--model DIR | --preset llama-1b] [--tp N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import ray

from bench.checkpoints import make_random_checkpoint
from raygraph.client.connect import connect, start_coordinator
from raygraph.config import (
    DEFAULT_MODEL,
    GraphConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.protocol import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="random-weight checkpoint (bench/checkpoints.py)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--mode", choices=["graph", "eager"], default="graph")
    a = p.parse_args()
    model = a.model or DEFAULT_MODEL
    if a.preset:
        model = str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    connect(None, log_to_driver=False)
    cfg = ServeConfig(
        model=model, parallel=ParallelConfig(tp=a.tp),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs,
                                  max_num_batched_tokens=a.max_num_batched_tokens),
        graph=GraphConfig(mode=a.mode, capture="at_start"),  # steady state
    )
    coord = start_coordinator(cfg)
    info = ray.get(coord.describe.remote())
    vocab = 1000
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.num_prompts)]
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    ray.get(coord.generate.remote(prompts[:2], SamplingParams(max_tokens=4)))  # warm-up
    t0 = time.perf_counter()
    results = ray.get([coord.generate.remote(pr, params) for pr in prompts])
    dt = time.perf_counter() - t0
    out_tokens = sum(len(r[0].token_ids) for r in results)
    stats = ray.get(coord.stats.remote())
    print(json.dumps({
        "model": model, "device": info["device"], "dtype": info["dtype"], "tp": a.tp,
        "mode": a.mode, "buckets": info["buckets_captured"], "graphs": info["graphs_captured"],
        "capture_s": info["capture_s"], "graph_pool_mib": info["graph_pool_bytes"] >> 20,
        "num_prompts": a.num_prompts, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
        "seconds": round(dt, 3), "output_tokens_per_s": round(out_tokens / dt, 1),
        "total_tokens_per_s": round((out_tokens + a.num_prompts * a.prompt_len) / dt, 1),
        "steps": stats["steps"], "preemptions": stats["preemptions"],
    }))
    ray.get(coord.shutdown.remote())


if __name__ == "__main__":
    main()
