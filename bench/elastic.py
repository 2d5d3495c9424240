"""An elastic replica woken by a burst: what a client sees of scaling from idle.

Two replicas, one kept awake (replica.min_replicas 1). The other sleeps once idle
(replica.idle_sleep_s), then a burst of twice a replica's batch arrives at once: the
requests past replica 0's batch go to the sleeping replica, which wakes for them. The
figure is their time to first token from the burst's arrival (goal: <= 0.3 s), beside the
same burst a moment later with both replicas awake, and the engine's own wake time.

    python -m bench.elastic --model DIR [--max-num-seqs 64 --input-len 128 --output-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import ray
import torch

from raygraph.client.connect import connect, start_coordinator
from raygraph.client.streams import ReplicaStreams
from raygraph.config import (
    CacheConfig,
    GraphConfig,
    ModelConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.protocol import SamplingParams, replica_of


async def burst(streams: ReplicaStreams, prompts: list[list[int]], params: SamplingParams
                ) -> list[tuple[int, float]]:
    """(replica, seconds to its first token from the burst's arrival) per request."""
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> tuple[int, float]:
        rid = await streams.open(prompt, params)
        first = None
        while True:
            delta = await streams.next(rid)
            if first is None and delta.token_ids:
                first = time.perf_counter() - t0
            if delta.finish_reason == "error":
                raise RuntimeError(delta.error)
            if delta.finish_reason is not None:
                return replica_of(rid), first

    return await asyncio.gather(*(one(p) for p in prompts))


def summary(results: list[tuple[int, float]]) -> dict[str, Any]:
    """Per replica: requests, first / median / last TTFT in ms."""
    out = {}
    for r in sorted({r for r, _ in results}):
        t = sorted(ttft for rep, ttft in results if rep == r)
        out[f"replica_{r}"] = {"requests": len(t), "ttft_first_ms": round(t[0] * 1e3, 1),
                               "ttft_p50_ms": round(t[len(t) // 2] * 1e3, 1),
                               "ttft_max_ms": round(t[-1] * 1e3, 1)}
    return out


def replica_stats(coord: Any, replica: int) -> dict:
    return ray.get(coord.stats.remote())["replicas"][replica]


def wait_asleep(coord: Any, timeout: float) -> float:
    """Seconds until replica 1 sleeps because idle."""
    t0 = time.monotonic()
    while not replica_stats(coord, 1).get("idle_asleep"):
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"replica 1 did not sleep within {timeout:.0f}s")
        time.sleep(0.1)
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--idle-sleep-s", type=float, default=5.0)
    p.add_argument("--level", type=int, choices=[1, 2], default=1)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    a = p.parse_args()
    connect(None, log_to_driver=False)
    cfg = ServeConfig(
        model=a.model, device=a.device,
        replica=ReplicaConfig(replicas=2, min_replicas=1, idle_sleep_s=a.idle_sleep_s,
                              idle_sleep_level=a.level, routing="load"),
        cache=CacheConfig(num_blocks=a.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs),
        graph=GraphConfig(capture="at_start"),
    ).resolved(torch.cuda.device_count())
    coord = start_coordinator(cfg)
    vocab = ModelConfig.from_pretrained(a.model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)]
               for _ in range(2 * a.max_num_seqs)]
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
    row: dict[str, Any] = {"model": a.model, "device": cfg.device,
                           "max_num_seqs": a.max_num_seqs, "input_len": a.input_len,
                           "output_len": a.output_len, "level": a.level}

    async def run() -> tuple[list, list]:  # one event loop: the streams' subscriptions
        streams = ReplicaStreams.from_info(coord, await coord.describe.remote())
        await burst(streams, prompts, params)  # warm-up: both replicas serve
        row["slept_after_s"] = round(await asyncio.to_thread(
            wait_asleep, coord, 10 * a.idle_sleep_s + 60), 2)
        cold = await burst(streams, prompts, params)
        return cold, await burst(streams, prompts, params)

    cold, warm = asyncio.run(run())
    woken = replica_stats(coord, 1)
    row |= {"asleep_burst": summary(cold), "awake_burst": summary(warm),
            "wake_s": woken["last_wake_s"], "idle_sleeps": woken["idle_sleeps"]}
    ray.get(coord.shutdown.remote())
    print(json.dumps(row), flush=True)
    first = row["asleep_burst"].get("replica_1", {}).get("ttft_first_ms")
    print(f"woken replica: first token {first} ms after the burst (wake {row['wake_s']} s); "
          f"awake: {row['awake_burst'].get('replica_1', {}).get('ttft_first_ms')} ms",
          file=sys.stderr)


if __name__ == "__main__":
    main()
