"""Sleep and wake of one worker: memory released, sleep and wake time, greedy tokens equal.

    python -m bench.sleep [--preset llama-1b] [--levels 1 2]      # GPU: the full schedule
    python -m bench.sleep --device cpu                             # CPU smoke, built-in model

On a GPU: the preset's random checkpoint, the KV cache sized as serving sizes it, the whole
capture schedule; per level, device free memory (mem_get_info) awake / asleep / woken, what
the worker reports it released (graph pool, KV cache, weights), sleep and wake seconds, and
whether greedy tokens after wake equal those before and no graph was recaptured. One JSON
line per level. On a CPU the same runs over memfd (no mem_get_info figures).

Wake is staged by default (CacheConfig.staged_wake): `wake_s` is the time until wake_up
returned (serving possible) with `kv_blocks_ready` of `kv_blocks` mapped; the greedy tokens
run at once, from those blocks, while a thread maps the rest; `kv_whole_s` is the time from
the wake until the whole KV cache was mapped. `--no-staged-wake`: wake maps everything first.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.graph.buckets import bucket_plan
from raygraph.protocol import SamplingParams
from raygraph.worker.worker import Worker

MiB = 2**20
PROMPTS = [[1, 306, 3658, 278, 2593, 310, 2834, 338], [1, 450, 3996, 1354, 1701, 2916],
           [1, 512, 1024, 77, 3], [1, 2987, 13, 2277, 2937, 2280, 3323, 2184, 11]]  # < 4096


def kv_blocks(w: Worker) -> int:
    return w.kv_cache_bytes // w.kv_bytes_per_block()


def greedy_tokens(w: Worker, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `prompts` through the served loop's logic, in this process, from
    the KV blocks mapped now (a staged wake may still be mapping the rest)."""
    c, blocks = w.cfg, kv_blocks(w)
    pool = PagePool(blocks, c.cache.block_size)
    pool.set_online(min(blocks, w.kv_blocks_ready()))
    sched = Scheduler(pool, c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens,
                      c.max_model_len(w.model_cfg, blocks), ())
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    run_to_completion(EngineCore([sched], bucket_plan(c), ep=False), local_dispatch(w))
    return [s.output_token_ids for s in seqs]


def device_free(w: Worker) -> int | None:
    """Free device bytes with nothing cached by torch (None on a CPU)."""
    if w.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def physical_bytes(w: Worker) -> int:
    """What the worker holds in its sleepable memory (graph pool and both arenas)."""
    m = w.memory_stats()
    return sum(s.physical_bytes if hasattr(s, "physical_bytes") else s.held_bytes
               for s in (m.graph, m.kv_cache_vmm, m.weight_vmm) if s is not None)


def mib(n: int | None) -> float | None:
    return None if n is None else round(n / MiB, 1)


def wait_whole_kv(w: Worker, t0: float, timeout_s: float = 60.0) -> float:
    """Seconds from t0 until the worker has mapped its whole KV cache (polled every 0.2 ms,
    as the coordinator polls between steps, only finer)."""
    blocks = kv_blocks(w)
    while w.kv_blocks_ready() < blocks:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{w.kv_blocks_ready()} of {blocks} KV blocks after {timeout_s}s")
        time.sleep(2e-4)
    return time.perf_counter() - t0


def cycle(w: Worker, level: int, before: list[list[int]], max_tokens: int,
          asleep_s: float = 0.0) -> dict:
    graphs = dict(getattr(w.executor, "graphs", {}))
    held = physical_bytes(w)
    free0 = device_free(w)
    t0 = time.perf_counter()
    slept = w.sleep(level)
    sleep_s = time.perf_counter() - t0
    free1, asleep = device_free(w), physical_bytes(w)
    time.sleep(asleep_s)  # the driver scrubs released memory meanwhile (see --asleep-s)
    t0 = time.perf_counter()
    woke = w.wake_up()
    wake_s = time.perf_counter() - t0
    after = greedy_tokens(w, PROMPTS, max_tokens)  # served while the rest is mapped
    tokens_s, ready_after_tokens = time.perf_counter() - t0, w.kv_blocks_ready()
    whole_s = wait_whole_kv(w, t0)
    free2 = device_free(w)
    blocks = kv_blocks(w)  # the upper half: what the driver gave (the tokens wrote below)
    kv_zero = not bool(w.model.attention_layers()[0].k_cache[blocks // 2: blocks].any())
    now = getattr(w.executor, "graphs", {})
    return {
        "level": level, "device": str(w.device), "asleep_s": asleep_s,
        "free_awake_mib": mib(free0), "free_asleep_mib": mib(free1), "free_woken_mib": mib(free2),
        "released_mib": mib(None if free0 is None else free1 - free0),
        "retaken_mib": mib(None if free0 is None else free1 - free2),
        "reported_mib": {"graph": mib(slept.graph_bytes), "kv_cache": mib(slept.kv_cache_bytes),
                         "weights": mib(slept.weight_bytes), "total": mib(slept.total_bytes)},
        "held_awake_mib": mib(held), "held_asleep_mib": mib(asleep),
        "remapped_mib": mib(woke.total_bytes),
        "sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
        "staged": w.cfg.cache.staged_wake, "kv_blocks": blocks,
        "kv_blocks_ready": woke.kv_blocks_ready, "first_slice_mib": mib(woke.kv_cache_bytes),
        "tokens_done_s": round(tokens_s, 4), "kv_blocks_ready_at_tokens_done": ready_after_tokens,
        "kv_whole_s": round(whole_s, 4),
        "tokens_equal": after == before, "kv_zero_after_wake": kv_zero,
        "tokens": sum(len(t) for t in after),
        "recaptured": any(now.get(k) is not r for k, r in graphs.items()),
        "graphs": len(graphs),
    }


def make_worker(a: argparse.Namespace) -> Worker:
    if a.device == "cuda":
        from bench.checkpoints import make_random_checkpoint

        model = str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
        dtype = "bfloat16"
    else:
        model, dtype = ServeConfig().model, "float32"  # the built-in model
    cfg = ServeConfig(
        model=model, device=a.device, dtype=dtype,
        cache=CacheConfig(num_blocks=a.num_blocks, staged_wake=not a.no_staged_wake,
                          **({"wake_first_bytes": int(a.wake_first_mib * MiB)}
                             if a.wake_first_mib else {})),
        scheduler=SchedulerConfig(max_num_seqs=a.max_decode, max_num_batched_tokens=a.max_prefill),
        graph=GraphConfig(max_decode=a.max_decode, max_prefill=a.max_prefill),
    )
    w = Worker(cfg, 0)
    info = w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(info.num_kv_blocks)
    t0 = time.perf_counter()
    w.capture_all()
    kv = w.memory_stats().kv_cache_vmm
    print(json.dumps({"part": "setup", "model": model, "weights_mib": mib(w.weight_bytes),
                      "kv_cache_mib": mib(w.kv_cache_bytes), "kv_blocks": info.num_kv_blocks,
                      "kv_chunks": kv.chunks if kv else None,
                      "kv_chunk_mib": mib(kv.chunk_size) if kv else None,
                      "capture_s": round(time.perf_counter() - t0, 2),
                      "held_mib": mib(physical_bytes(w))}), flush=True)
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="llama-1b", help="bench/checkpoints.py preset (GPU)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-decode", type=int, default=None,
                   help="largest decode bucket and max_num_seqs (default: 256 GPU, 16 CPU)")
    p.add_argument("--max-prefill", type=int, default=None,
                   help="largest prefill bucket and step token budget (default: 2048 GPU, "
                        "64 CPU)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: sized from free memory, as serving does)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-staged-wake", action="store_true",
                   help="wake maps the whole KV cache before it returns")
    p.add_argument("--wake-first-mib", type=float, default=None,
                   help="KV bytes a staged wake maps before it returns (default: "
                        "CacheConfig.wake_first_bytes, 2 GiB)")
    p.add_argument("--asleep-s", type=float, nargs="+", default=[0.0],
                   help="seconds asleep before each wake (every level runs once per value): "
                        "a wake right after the release waits for the driver to scrub the "
                        "chunks it hands back")
    a = p.parse_args()
    gpu = a.device == "cuda"
    a.max_decode = a.max_decode or (256 if gpu else 16)
    a.max_prefill = a.max_prefill or (2048 if gpu else 64)
    w = make_worker(a)
    before = greedy_tokens(w, PROMPTS, a.max_tokens)
    for level in a.levels:
        for asleep_s in a.asleep_s:
            print(json.dumps(cycle(w, level, before, a.max_tokens, asleep_s)), flush=True)
    w.shutdown()


if __name__ == "__main__":
    main()
