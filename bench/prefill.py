"""Prefill steps on one GPU: no per-shape planning, the GEMM floor, piecewise vs full graphs.

    python -m bench.prefill [--preset llama-1b] [--steps 50] [--modes piecewise full]
    python -m bench.prefill --profile [--preset llama3-8b --load-format dummy]
        [--quantization fp8] [--kv-cache-dtype fp8] [--mixed --blocks 24576]

Per prefill-graph mode, in one run (a Worker in this process, the whole prefill schedule up
to 2048 tokens captured first; capture seconds, graph memory and launches reported):
- `--steps` prefill steps of random compositions, each new: the total drawn uniformly inside
  one of the buckets 64/256/512/1024/2048 (above the capture size below it, so each of the
  five buckets gets about a fifth of the steps), split over
  1-64 sequences with random cached prefixes (0-1024 tokens). Every step is timed from the
  plan to the logits on the host, its first and only run; reported: each step over the
  median step of its bucket (the first-shape spike the cuDNN path had: 51-63 ms against
  ~10 ms, bench/RESULTS.md).
- 2048-token steps (1 x 2048, 16 x 128, 64 x 32) against the GEMM floor:
  2 x parameters x tokens / the bf16 matmul rate of an 8192^3 torch.mm measured here.
Also, per layer, the attention op alone on the served prefill compositions: the torch reference
(first call, then warm) against the Triton kernel.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from bench.checkpoints import add_weight_flags, bench_model
from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.graph.inputs import prepare_batch
from raygraph.protocol import SeqChunk, StepPlan
from raygraph.worker.worker import Worker

BS = 16
BUCKETS = (64, 256, 512, 1024, 2048)


def matmul_rate(n: int = 8192) -> float:
    """Dense bf16 FLOP/s of one large torch.mm (cuBLAS): the floor's denominator."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return _rate(lambda: a @ b, n)


def fp8_matmul_rate(n: int = 8192) -> float:
    """Dense FLOP/s of one large e4m3 `torch._scaled_mm` (cuBLASLt, per-tensor scales)."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return _rate(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), n)


def _rate(mm, n: int) -> float:
    """FLOP/s of an n^3 product `mm`: 20 calls after 3 to warm up."""
    for _ in range(3):
        mm()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        mm()
    torch.cuda.synchronize()
    return 20 * 2 * n**3 / (time.perf_counter() - t0)


def plan_of(lens: list[tuple[int, int]], rng: random.Random, blocks: int) -> StepPlan:
    """(cached prefix, new tokens) per sequence, on disjoint random blocks."""
    free = rng.sample(range(blocks), blocks)
    seqs = []
    for i, (ctx, n) in enumerate(lens):
        nb = -(-(ctx + n) // BS)
        table, free = free[:nb], free[nb:]
        seqs.append(SeqChunk(i, [rng.randrange(3, 32000) for _ in range(n)], ctx, table, True))
    return StepPlan(0, seqs)


def random_lens(rng: random.Random, sizes: list[int]) -> list[tuple[int, int]]:
    """A composition whose total lands in one of BUCKETS: above the capture size below it."""
    b = rng.choice(BUCKETS)
    below = max([s for s in sizes if s < b], default=7)
    total = rng.randrange(below + 1, b + 1)
    num = rng.randrange(1, min(64, total) + 1)
    cuts = sorted(rng.sample(range(1, total), num - 1))
    sizes_ = [y - x for x, y in zip([0, *cuts], [*cuts, total])]
    return [(rng.randrange(0, 1025), n) for n in sizes_]


def timed_step(worker: Worker, plan: StepPlan) -> float:
    """From the plan to the sampled tokens on the host, as a served step ends."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    worker.execute(plan)
    return time.perf_counter() - t0


def _ms(fn, *args) -> list[float]:
    """Three calls, each synchronised: the first pays any per-shape planning."""
    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def attention_ops(worker: Worker, blocks: int) -> list[dict]:
    """One layer's attention on the served prefill compositions: reference first/warm vs kernel."""
    from raygraph.model.ops import paged_attention_ref
    from raygraph.model.triton_attention import paged_prefill_attention

    layer = worker.model.attention_layers()[0]
    rows, rng = [], random.Random(1)
    for num, n in ((16, 128), (64, 32), (4, 512), (1, 2048)):
        md = prepare_batch(plan_of([(0, n)] * num, rng, blocks), BS,
                           torch.device("cuda")).ctx.attn
        q = torch.randn(num * n, layer.num_heads, layer.head_dim, device="cuda",
                        dtype=layer.k_cache.dtype)

        ref = _ms(paged_attention_ref, q, layer.k_cache, layer.v_cache, md, layer.scale)
        ker = _ms(paged_prefill_attention, q, layer.k_cache, layer.v_cache, md.block_tables,
                  md.seq_lens, md.query_start, layer.scale)
        rows.append({"composition": f"{num}x{n}", "ref_first_ms": round(ref[0], 3),
                     "ref_warm_ms": round(ref[-1], 3), "kernel_first_ms": round(ker[0], 3),
                     "kernel_warm_ms": round(ker[-1], 3)})
    return rows


def prefill_worker(model: str, mode: str, blocks: int, load_format: str = "auto",
                   quantization: str = "auto", kv_cache_dtype: str = "auto",
                   max_num_seqs: int = 64) -> Worker:
    cfg = ServeConfig(
        model=model, device="cuda", load_format=load_format, quantization=quantization,
        cache=CacheConfig(block_size=BS, num_blocks=blocks, cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        graph=GraphConfig(decode_sizes=[1], max_prefill=2048, prefill_graph=mode),
    ).resolved(1)
    worker = Worker(cfg, 0)
    worker.load(("127.0.0.1", 0))
    worker.allocate_kv_cache(blocks)
    return worker


def run_mode(model: str, mode: str, a: argparse.Namespace, rate: float) -> dict:
    worker = prefill_worker(model, mode, a.blocks)
    t0 = time.perf_counter()
    records = [r for r in worker.capture_all() if r.key.phase == "prefill"]
    capture_s = time.perf_counter() - t0
    stats = worker.executor.pool_stats()
    gc.collect()
    gc.freeze()  # as a served worker does: no collection of the start-up heap mid-step
    params = sum(p.numel() for p in worker.model.parameters())
    # the weights a prefill token multiplies by: not the embedding table (a lookup) nor the
    # lm_head (one row per sequence); counting them inflates the floor by ~13% on llama-1b
    lookups = {id(p) for m in (worker.model.model.embed_tokens, worker.model.lm_head)
               for p in m.parameters()}
    gemm_params = sum(p.numel() for p in worker.model.parameters() if id(p) not in lookups)
    rng = random.Random(a.seed)
    # warm the Triton kernels and the allocator on one step outside the measured ones
    timed_step(worker, plan_of([(0, 100)], rng, a.blocks))
    steps, plans = [], []
    for _ in range(a.steps):
        plan = plan_of(random_lens(rng, list(worker.executor.buckets.prefill_sizes)), rng,
                       a.blocks)
        key = worker.executor.key_for(worker.executor.inputs(plan))
        steps.append((key.num_tokens, len(plan.seqs), timed_step(worker, plan)))
        plans.append(plan)
    by_bucket: dict[int, list[float]] = {}
    for b, _, s in steps:
        by_bucket.setdefault(b, []).append(s)
    medians = {b: statistics.median(v) for b, v in by_bucket.items()}
    worst_at = max(range(len(steps)), key=lambda i: steps[i][2] / medians[steps[i][0]])
    worst = steps[worst_at]
    # the same composition again: a first-use cost (a kernel loaded, a buffer grown) does not
    # come back; a host or clock hiccup does not either, but then other steps show it too
    rerun = [round(1e3 * timed_step(worker, plans[worst_at]), 3) for _ in range(3)]
    full_steps = {}
    for num, n in ((1, 2048), (16, 128), (64, 32)):
        times = [timed_step(worker, plan_of([(0, n)] * num, rng, a.blocks)) for _ in range(6)]
        full_steps[f"{num}x{n}"] = round(1e3 * statistics.median(times[1:]), 3)
    floor_ms = 1e3 * 2 * params * 2048 / rate
    gemm_floor_ms = 1e3 * 2 * gemm_params * 2048 / rate
    key2048 = next(r for r in records if r.key.num_tokens == 2048)
    layers = len(worker.model.attention_layers())
    # host launches per replayed step: graph replays, plus per layer (piecewise) the eager
    # zero of the shared output, the K/V store and the attention kernel
    launches = key2048.pieces + (3 * layers if mode == "piecewise" else 0)
    out = {
        "prefill_graph": mode, "buckets": len(records), "capture_s": round(capture_s, 2),
        "prefill_capture_s_sum": round(sum(r.seconds for r in records), 2),
        "graph_pool_mib": round(stats.held_bytes / 2**20, 1) if stats else None,
        "launches_per_step_2048": launches, "graph_nodes_2048": key2048.nodes,
        "random_steps": len(steps),
        "per_bucket_median_ms": {b: round(1e3 * m, 3) for b, m in sorted(medians.items())},
        "per_bucket_steps": {b: len(v) for b, v in sorted(by_bucket.items())},
        "max_step_over_bucket_median": round(worst[2] / medians[worst[0]], 3),
        "worst_step": {"bucket": worst[0], "seqs": worst[1], "ms": round(1e3 * worst[2], 3),
                       "index": worst_at, "rerun_ms": rerun,
                       "first_with_its_seqs": all(s[1] != worst[1] for s in steps[:worst_at])},
        "step_2048_ms": full_steps, "params": params,
        "matmul_tflops": round(rate / 1e12, 1), "gemm_floor_2048_ms": round(floor_ms, 3),
        "step_2048_over_floor": {k: round(v / floor_ms, 3) for k, v in full_steps.items()},
        "gemm_params": gemm_params, "gemm_only_floor_2048_ms": round(gemm_floor_ms, 3),
        "step_2048_over_gemm_only_floor": {k: round(v / gemm_floor_ms, 3)
                                           for k, v in full_steps.items()},
    }
    if a.ops and mode == a.modes[0]:
        out["attention_op_per_layer"] = attention_ops(worker, a.blocks)
    worker.shutdown()
    return out


# a served step of the 1000/1000 load while prompts arrive: 248 decode rows at 1,500 keys
# (one new token each; running sequences first, as the scheduler orders them) beside two
# prompt chunks, 2,048 tokens
MIXED = [(1500, 1)] * 248 + [(0, 900)] * 2


def profile(worker: Worker, blocks: int, mixed: bool = False) -> None:
    """Where a 2048-token full prefill graph's time goes: GPU time per kernel of one replay,
    after a step of each composition has filled the input buffers (`mixed`: MIXED's only)."""
    from bench.decode_profile import graph_kernels

    worker.capture_all()
    rng = random.Random(3)
    cases = {"248x1@1500+2x900": MIXED} if mixed else {
        f"{num}x{n}": [(0, n)] * num for num, n in ((1, 2048), (16, 128))}
    for name, lens in cases.items():
        plan = plan_of(lens, rng, blocks)
        step_ms = 1e3 * statistics.median(timed_step(worker, plan) for _ in range(5))
        graph = worker.executor.graphs[worker.executor.last_key].graph
        print(json.dumps({"composition": name, "step_ms": round(step_ms, 3),
                          **graph_kernels(graph, top=30)}), flush=True)


def sweep(worker: Worker, blocks: int) -> None:
    """Tile configs of the prefill kernel, one layer's attention replayed in a graph (no
    launch overhead) on the served prefill compositions: microseconds per call."""
    from raygraph.model.triton_attention import paged_prefill_attention

    layer = worker.model.attention_layers()[0]
    rng = random.Random(2)
    cases = []
    for num, n in ((1, 2048), (16, 128), (64, 32), (2, 1024)):
        md = prepare_batch(plan_of([(0, n)] * num, rng, blocks), BS,
                           torch.device("cuda")).ctx.attn
        q = torch.randn(num * n, layer.num_heads, layer.head_dim, device="cuda",
                        dtype=worker.dtype)
        cases.append((f"{num}x{n}", md, q))
    for tiles in [(r, n, w, st) for r in (64, 128, 256) for n in (32, 64, 128)
                  for w in (4, 8) for st in (1, 2, 3)]:
        row = {"tiles": tiles}
        try:
            for name, md, q in cases:
                def call(md=md, q=q, tiles=tiles):
                    return paged_prefill_attention(q, layer.k_cache, layer.v_cache,
                                                   md.block_tables, md.seq_lens, md.query_start,
                                                   layer.scale, tiles=tiles)
                call()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(10):
                        call()
                graph.replay()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
                row[name] = round(1e6 * (time.perf_counter() - t0) / 50, 1)
        except Exception as e:  # a config the compiler refuses (registers, shared memory)
            row["error"] = str(e).splitlines()[0][:80]
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=12288)
    p.add_argument("--modes", nargs="+", default=["piecewise", "full"])
    p.add_argument("--no-ops", dest="ops", action="store_false",
                   help="skip the attention-op comparison with the torch reference")
    p.add_argument("--sweep", action="store_true", help="time the kernel's tile configs only")
    p.add_argument("--profile", action="store_true",
                   help="kernel times inside the full 2048-token prefill graph only")
    p.add_argument("--mixed", action="store_true",
                   help="--profile: a served 1000/1000 step's composition instead (prompt "
                        "chunks beside 248 decode rows; 256 sequence rows; --blocks 24576)")
    add_weight_flags(p, "; with --profile (--kv-cache-dtype: --sweep too)")
    a = p.parse_args()
    model = bench_model(a.preset, a.load_format if a.profile else "auto")
    if a.sweep:
        cfg = ServeConfig(model=model, device="cuda", graph=GraphConfig(mode="eager"),
                          cache=CacheConfig(block_size=BS, num_blocks=a.blocks,
                                            cache_dtype=a.kv_cache_dtype)).resolved(1)
        worker = Worker(cfg, 0)
        worker.load(("127.0.0.1", 0))
        worker.allocate_kv_cache(a.blocks)
        return sweep(worker, a.blocks)
    rate = matmul_rate()
    if a.profile:
        print(json.dumps({"matmul_tflops": round(rate / 1e12, 1),
                          "fp8_matmul_tflops": round(fp8_matmul_rate() / 1e12, 1)}))
        return profile(prefill_worker(model, "full", a.blocks, a.load_format, a.quantization,
                                      a.kv_cache_dtype, 256 if a.mixed else 64),
                       a.blocks, a.mixed)
    for mode in a.modes:
        print(json.dumps({"preset": a.preset, **run_mode(model, mode, a, rate),
                          "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
