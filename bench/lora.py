"""Many LoRA adapters against the base model on the same load.

N registered rank-R adapters (default 1000, rank 16) over `--distinct` random PEFT
directories (names round-robin over them, to keep disk and set-up small: each name is still
its own adapter id, slot and prefix-cache key; NOTE the workers' warm tier keys host copies
by directory, so after a directory's first read its other names promote warm -> hot),
`--max-loras` hot slots, a Zipf(s) mix over the names at `--streams` concurrent closed-loop
streams (input-len random tokens in, output-len greedy tokens out, ignore_eos). The same
streams run first against a coordinator without LoRA, then against one with the adapters.
Prints one JSON object: output tok/s both ways and their ratio (target >= 0.8), the hot hit
rate, warm->hot and cold->hot load times as served (the host's part), warm->hot with its
device copy timed in one process (target <= 1 ms for one rank-16 adapter), and the graph
pool bytes with and without LoRA.

    python -m bench.lora [--preset llama-1b | --model DIR] [--num-adapters 1000]
                         [--distinct 50] [--rank 16] [--all-modules] [--max-loras 32]
                         [--streams 64] [--input-len 128] [--output-len 128] [--zipf 1.1]
                         [--seconds 60] [--warmup-seconds 10] [--workdir DIR]

CPU smoke test:
    python -m bench.lora --model raygraph/assets/default_model --num-adapters 8 --distinct 2
                         --max-loras 2 --streams 4 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import random
import sys
import time
from pathlib import Path

import ray
import torch
from safetensors.torch import save_file

from bench.checkpoints import make_random_checkpoint
from raygraph.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from raygraph.client.connect import connect, start_coordinator
from raygraph.config import (
    CacheConfig,
    GraphConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.lora.adapter import module_shapes
from raygraph.protocol import SamplingParams

BLOCK = 16
QV = ["q_proj", "v_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: Path, cfg: ModelConfig, targets: list[str], rank: int, seed: int
                 ) -> Path:
    """A random PEFT LoRA directory (both A and B nonzero, small), written directly."""
    if (path / WEIGHTS_FILE).is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            in_f, out_f = module_shapes(cfg)[module]
            where = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g)
                                               / in_f**0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g)
                                               * 0.1 / rank**0.5).to(torch.bfloat16)
    save_file(tensors, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets,
        "bias": "none"}))
    return path


def zipf_picker(n: int, s: float, rng: random.Random):
    """Draws name indices 0..n-1 with P(k) proportional to 1 / (k + 1)^s."""
    cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
    return lambda: min(n - 1, bisect.bisect_left(cum, rng.random() * cum[-1]))


def config(a: argparse.Namespace, model: str, lora: LoRAConfig) -> ServeConfig:
    blocks = None
    if a.device == "cpu" or (a.device == "auto" and not torch.cuda.is_available()):
        blocks = a.streams * -(-(a.input_len + a.output_len) // BLOCK) + 16
    return ServeConfig(
        model=model, device=a.device, coordinator_name="lora-bench",
        cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=a.streams,
                                  max_num_batched_tokens=max(2048, a.input_len)),
        graph=GraphConfig(capture="at_start"),  # steady state: no capture in the window
        lora=lora)


async def closed_loop(coord, a: argparse.Namespace, names: list[str | None], vocab: int
                      ) -> dict:
    """`a.streams` streams, each sending its next request when the last returns, for
    warmup + seconds; counts what finished in the timed window."""
    rng = random.Random(a.seed)
    pick = zipf_picker(len(names), a.zipf, rng)
    start = time.perf_counter() + a.warmup_seconds
    end = start + a.seconds
    tokens = requests = 0

    async def stream(i: int) -> None:
        nonlocal tokens, requests
        r = random.Random(a.seed * 1000 + i)
        while time.perf_counter() < end:
            name = names[pick()]
            prompt = [r.randrange(3, vocab) for _ in range(a.input_len)]
            params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                                    lora=name)
            (res,) = await coord.generate.remote([prompt], params)
            now = time.perf_counter()
            if start <= now <= end:
                tokens += len(res.token_ids)
                requests += 1

    stats0 = None

    async def mark() -> None:
        nonlocal stats0
        await asyncio.sleep(a.warmup_seconds)
        stats0 = await coord.stats.remote()

    await asyncio.gather(mark(), *(stream(i) for i in range(a.streams)))
    stats1 = await coord.stats.remote()
    return {"output_tok_s": round(tokens / a.seconds, 1), "requests": requests,
            "stats0": stats0, "stats1": stats1}


def phase(a: argparse.Namespace, model: str, lora: LoRAConfig, names: list[str | None],
          vocab: int) -> dict:
    t0 = time.perf_counter()
    coord = start_coordinator(config(a, model, lora))
    started = time.perf_counter() - t0
    try:
        out = asyncio.run(closed_loop(coord, a, names, vocab))
    finally:
        ray.get(coord.shutdown.remote())
        ray.kill(coord)
    out["start_s"] = round(started, 1)
    return out


def lora_summary(s0: dict | None, s1: dict) -> dict:
    """The timed window's hot hits and moves, and load times over the whole run."""
    l0, l1 = (s0 or {}).get("lora") or {"hits": 0, "misses": 0, "moves": []}, s1["lora"]
    hits, misses = l1["hits"] - l0["hits"], l1["misses"] - l0["misses"]
    before = {(f, t): n for f, t, n in l0["moves"]}
    return {"hot_hit_rate": round(hits / max(1, hits + misses), 4), "hits": hits,
            "misses": misses,
            "moves": {f"{f}->{t}": n - before.get((f, t), 0) for f, t, n in l1["moves"]},
            "load_ms_whole_run": l1["load_ms"]}


def promotion_ms(a: argparse.Namespace, model: str, dirs: list[Path], reps: int = 200
                 ) -> dict:
    """Warm -> hot in one process, device copy included: each distinct adapter is read once
    (cold), then `reps` promotions into rotating slots, each timed to the end of its copies
    (`Worker.load_lora` waits for the device). The served path's `lora_load_seconds` times
    only the host's part: its copies run on the step stream, behind the step in flight."""
    from raygraph.worker.worker import Worker

    lora = LoRAConfig(max_loras=a.max_loras, max_lora_rank=a.rank,
                      modules=tuple((f"d{i}", str(d)) for i, d in enumerate(dirs)))
    cfg = ServeConfig(model=model, device=a.device, cache=CacheConfig(block_size=BLOCK,
                      num_blocks=64), graph=GraphConfig(mode="eager"), lora=lora).resolved(1)
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    for i, d in enumerate(dirs):
        w.load_lora(i % a.max_loras, str(d))
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        tier, _ = w.load_lora(i % a.max_loras, str(dirs[(i * 7) % len(dirs)]))
        times.append((time.perf_counter() - t0) * 1e3)
        assert tier == "warm", tier
    times.sort()
    return {f"p{q}": round(times[min(len(times) - 1, int(q / 100 * len(times)))], 3)
            for q in (50, 90, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: --preset)")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--workdir", default="/tmp/raygraph-lora-bench")
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--distinct", type=int, default=50)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--all-modules", action="store_true", help="all seven (default: q, v)")
    p.add_argument("--max-loras", type=int, default=32)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="untimed load first (default: 10 on GPU, 1 on CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    gpu = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.warmup_seconds is None:
        a.warmup_seconds = 10.0 if gpu else 1.0
    work = Path(a.workdir)
    model = a.model or str(make_random_checkpoint(work / a.preset, a.preset))
    cfg = ModelConfig.from_pretrained(model)
    targets = ALL if a.all_modules else QV
    kind = f"{Path(model).name}-r{a.rank}-{'all' if a.all_modules else 'qv'}"
    dirs = [make_adapter(work / "adapters" / kind / str(i), cfg, targets, a.rank, i)
            for i in range(a.distinct)]
    names = [f"lora{i}" for i in range(a.num_adapters)]
    modules = tuple((n, str(dirs[i % len(dirs)])) for i, n in enumerate(names))
    connect(None, log_to_driver=False)
    print(f"base model alone: {a.streams} streams, {a.seconds}s", file=sys.stderr)
    base = phase(a, model, LoRAConfig(), [None], cfg.vocab_size)
    print(f"{a.num_adapters} adapters over {a.max_loras} slots", file=sys.stderr)
    lora = phase(a, model, LoRAConfig(max_loras=a.max_loras, max_lora_rank=a.rank,
                                      modules=modules), names, cfg.vocab_size)
    promo = promotion_ms(a, model, dirs) if gpu else None
    print(json.dumps({
        "model": Path(model).name, "device": "cuda" if gpu else "cpu",
        "num_adapters": a.num_adapters, "distinct_dirs": a.distinct, "rank": a.rank,
        "targets": targets, "max_loras": a.max_loras, "streams": a.streams,
        "input_len": a.input_len, "output_len": a.output_len, "zipf": a.zipf,
        "seconds": a.seconds,
        "base_output_tok_s": base["output_tok_s"], "lora_output_tok_s": lora["output_tok_s"],
        "ratio": round(lora["output_tok_s"] / max(1e-9, base["output_tok_s"]), 3),
        "requests": {"base": base["requests"], "lora": lora["requests"]},
        **lora_summary(lora["stats0"], lora["stats1"]),
        "graph_pool_bytes": {"base": base["stats1"]["graph_pool_bytes"],
                             "lora": lora["stats1"]["graph_pool_bytes"]},
        "start_s": {"base": base["start_s"], "lora": lora["start_s"]},
        "warm_to_hot_with_device_copy_ms": promo,
        "targets_met": {"ratio_ge_0.8": lora["output_tok_s"] >= 0.8 * base["output_tok_s"],
                        "warm_to_hot_p50_le_1ms": promo is not None and promo["p50"] <= 1.0},
    }, indent=1))


if __name__ == "__main__":
    main()
