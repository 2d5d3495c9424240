"""Where a decode step's time goes, on one GPU: the kernels inside the replayed graph
(torch.profiler; where they overlap, PDL, each one's share of the chain), the host-side
phases of `Worker.execute`, and the decode GEMMs alone (cuBLAS against the Triton skinny
kernels, per config).

    python -m bench.decode_profile [--preset llama-1b] [--cases 1x128 8x1024]
    python -m bench.decode_profile --gemm-only --preset llama3-8b [--gemm-fp8]
    python -m bench.decode_profile --skip-gemm --preset llama3-8b --load-format dummy
        [--quantization fp8] [--kv-cache-dtype fp8] [--verify K] --cases 1x128 256x256

Prints JSON lines. GEMM timings replay a CUDA graph of 20 calls cycling over weight copies
larger than L2, so each call streams its weight from HBM as in a real forward.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench.checkpoints import PRESETS, add_weight_flags, bench_model
from bench.decode_step import decode_plan, make_worker
from raygraph.graph.inputs import host_inputs
from raygraph.model.quant import DECODE_ROWS, Fp8Weight
from raygraph.worker.worker import Worker


def kernel_table(worker: Worker, batch: int, replays: int = 20) -> dict:
    """GPU time per kernel name over one replay of the decode graph of `batch`."""
    ex = worker.executor
    return graph_kernels(ex.graphs[ex.buckets.key(batch, batch, True)].graph, replays)


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int = 20, top: int = 16) -> dict:
    """GPU time per kernel name over one replay of a captured graph (torch.profiler)."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return kernel_summary(prof, replays, top)


def chain_table(worker: Worker, batch: int, replays: int = 20) -> dict:
    """Where a replay's time goes when kernels overlap (PDL): each kernel's share is how far
    it moves the end of everything launched before it, summed per kernel name; the kernel
    time alone (kernel_table) counts overlapped work twice."""
    ex = worker.executor
    graph = ex.graphs[ex.buckets.key(batch, batch, True)].graph
    graph.replay()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()  # replays apart: each one's kernels are one chain
    shares = chain_shares([(e.time_range.start, e.time_range.end, e.name[:70])
                           for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA])
    rows = sorted(((us / replays, n) for n, us in shares.items()), reverse=True)
    return {"busy_us_per_replay": round(sum(r[0] for r in rows), 1),
            "chain_top": [(n, round(us, 1)) for us, n in rows[:8]]}


def chain_shares(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per kernel name, the time by which its kernels (start, stop, name) moved the end of
    all kernels before them: overlapped work counts once, idle time for nobody."""
    shares: dict[str, float] = collections.defaultdict(float)
    end = -float("inf")
    for start, stop, name in sorted(kernels):
        shares[name] += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return dict(shares)


def kernel_summary(prof: torch.profiler.profile, runs: int, top: int = 16) -> dict:
    """GPU time and launches per kernel name, per run, of what `prof` recorded."""
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:70]].append(e.device_time)
    rows = sorted(((sum(v) / runs, len(v) / runs, n) for n, v in per_name.items()),
                  reverse=True)
    return {"kernels_per_replay": round(sum(r[1] for r in rows), 1),
            "kernel_us_per_replay": round(sum(r[0] for r in rows), 1),
            "top": [(n, round(us, 1), c) for us, c, n in rows[:top]]}


def host_phases(worker: Worker, batch: int, context: int, iters: int = 200) -> dict:
    """Median microseconds of each host-side phase of one graph decode step."""
    ex, bs = worker.executor, 16
    times = collections.defaultdict(list)
    for i in range(iters):
        plan = decode_plan(batch, context, bs, i)
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        h = host_inputs(plan, bs)
        t.append(time.perf_counter())
        key = ex.key_for(h)
        ex.bufs.write(h, key.num_tokens, key.num_tokens)
        t.append(time.perf_counter())
        ex.bufs.upload()
        t.append(time.perf_counter())
        md = ex.bufs.metadata(key.num_tokens, key.num_tokens, h.num_tokens, 1,
                             max(h.seq_lens), True)
        t.append(time.perf_counter())
        _, greedy = ex.graphs[key].run(md)
        t.append(time.perf_counter())
        greedy[:batch].tolist()
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        for name, a, b in zip(("host_inputs", "write", "upload", "metadata", "replay_call",
                                "tolist_sync", "sync"),
                              t, t[1:], strict=False):
            times[name].append(1e6 * (b - a))
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def host_timeline(worker: Worker, batch: int, context: int, steps: int = 30) -> dict:
    """Where a whole `Worker.execute` step waits on the host, from one profiler trace: host
    time before the step's first kernel starts (exposed), GPU busy span, host time after
    its last kernel ends (exposed), and the CPU-side calls that cost most per step."""
    plans = [decode_plan(batch, context, 16, i) for i in range(steps)]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for plan in plans:
            with torch.profiler.record_function("raygraph_step"):
                worker.execute(plan)
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    marks = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == "raygraph_step" and e.device_type == cpu)
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    phases = collections.defaultdict(list)
    for start, end in marks[3:]:  # the first steps carry profiler start-up
        ks = [k for k in kernels if start <= k[0] <= end]
        if not ks:
            continue
        phases["pre_us"].append(ks[0][0] - start)
        phases["gpu_us"].append(max(k[1] for k in ks) - ks[0][0])
        phases["post_us"].append(end - max(k[1] for k in ks))
        phases["step_us"].append(end - start)
    calls = sorted(((e.self_cpu_time_total / steps, e.count / steps, e.key)
                    for e in prof.key_averages()), reverse=True)[:14]
    return {**{k: round(statistics.median(v), 1) for k, v in phases.items()},
            "cpu_self_us_per_step": [(n[:40], round(us, 1), c) for us, c, n in calls]}


def time_graph(fn, reps: int = 20) -> float:
    """Seconds per call of fn() inside a CUDA graph of `reps` calls."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / reps


def _gemm_call(name: str, x: torch.Tensor, ws: list[torch.Tensor], cfg=None,
               act: torch.dtype | None = None):
    """fn(i): the decode GEMM `name` on weight copy i (cuBLAS when cfg is None; the skinny
    kernels' own choice for the rows when cfg is "auto"). `act`: x's float16 rows stand for
    that dtype's, as a norm or gate|up feeding an FP8 GEMM stores them (gate|up then stores
    float16 rows too, for the down projection)."""
    from raygraph.model import triton_gemv as tg

    m, half = x.shape[0], 32
    own = None if cfg == "auto" else cfg
    pos = torch.zeros(m, dtype=torch.long, device="cuda")
    table = torch.zeros(4096, half, device="cuda")

    def fn(i: int) -> torch.Tensor:
        w = ws[i % len(ws)]
        if cfg is None:
            return F.linear(x, w)
        if name == "qkv+rotary":
            return tg.gemv_rotary(x, w, None, pos, table, table, 2 * half, 40, own, act)
        if name == "gate_up+silu":
            return tg.gemv_silu_mul(x, w, own, act is not None, act)
        return tg.gemv(x, w, None, own, act)

    return fn


def _fp8_call(x: torch.Tensor, ws: list[Fp8Weight], kernel: str, cfg=None):
    """fn(i): x quantized per token, then x @ W^T on FP8 weight copy i through
    torch._scaled_mm or the Triton FP8 GEMM (cfg: its tiles, "auto" its own choice)."""
    from raygraph.model import triton_fp8_gemm
    from raygraph.model.ops import quantize_activations

    own = None if cfg in (None, "auto") else triton_fp8_gemm.Fp8GemmConfig(*cfg)

    def fn(i: int) -> torch.Tensor:
        w = ws[i % len(ws)]
        xq, xs = quantize_activations(x, None)
        if kernel == "scaled_mm":
            return torch._scaled_mm(xq, w.data.t(), scale_a=xs, scale_b=w.scale.view(1, -1),
                                    out_dtype=x.dtype)
        return triton_fp8_gemm.fp8_gemm(xq, xs, w.data, w.scale, x.dtype, cfg=own)

    return fn


def _block_call(x: torch.Tensor, ws: list[Fp8Weight], dequant: bool, cfg=None):
    """fn(i): x @ W^T on block-scaled weight copy i, as served (ops.linear), through a
    dequantized bf16 copy and cuBLAS (dequant), or (cfg) as served at those Triton tiles."""
    from raygraph.model import ops, triton_fp8_gemm

    own = None if cfg is None else triton_fp8_gemm.Fp8GemmConfig(*cfg)

    def fn(i: int) -> torch.Tensor:
        w = ws[i % len(ws)]
        if dequant:
            return F.linear(*ops.dense_operands(x, w))
        if own is None:
            return ops.linear(x, w)
        xq, xs = ops.quantize_activations(x.view(-1, w.group), None)
        return triton_fp8_gemm.fp8_gemm(xq.view(x.shape), xs.view(x.shape[0], -1), w.data,
                                        w.scale, x.dtype, cfg=own)

    return fn


def gemm_rows(name: str, n: int, k: int, configs: list[tuple[int, ...] | str],
              ms: tuple[int, ...] = (1, 8), fp8: bool = False,
              fp8_configs: list[tuple[str, tuple[int, ...]]] = (), block: int = 0,
              x_half: bool = False) -> None:
    """cuBLAS on bf16 weights against the Triton configs, on bf16 weights or (fp8) the same
    weights quantized per row: microseconds and the weight bytes' GB/s. Past 8 rows FP8
    also times the W8A8 GEMMs: _scaled_mm and the Triton FP8 GEMM (its own tiles and
    `fp8_configs`). block > 0: the weights quantized per row and `block` columns instead;
    past the decode rows the GEMM as served (ops.linear: the Triton GEMM with scales per
    group) against the weight dequantized to bf16 and cuBLAS (the path it replaced).
    x_half: the Triton configs take x as float16 rows standing for bf16 ones (at 2+ rows)."""
    from raygraph.model.quant import quantize
    from raygraph.model.triton_gemv import GemvConfig

    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    own_ws, size = ws, n * k * 2
    if fp8 or block:
        group = block or k
        own_ws = [Fp8Weight(*quantize(w, group), group, "dynamic") for w in ws]
        size //= 2
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t = time_graph(_gemm_call(name, x, ws))
        row = {"gemm": name, "n": n, "k": k, "m": m, "fp8": fp8, "block": block,
               "x_half": x_half,
               "cublas_us": round(1e6 * t, 2), "cublas_GBps": round(n * k * 2 / t / 1e9)}
        if block and m > DECODE_ROWS:
            for key, dequant in [("block_gemm_us", False), ("block_dequant_us", True)]:
                t = time_graph(_block_call(x, own_ws, dequant))
                row[key] = [round(1e6 * t, 2), round(size / t / 1e9)]
            for _, cfg in fp8_configs:  # the served GEMM at other tiles
                t = time_graph(_block_call(x, own_ws, False, cfg))
                row[f"block{cfg}"] = [round(1e6 * t, 2), round(size / t / 1e9)]
        if fp8 and m > 8:  # W8A8: x quantized per token, then _scaled_mm or the Triton GEMM
            for kernel, cfg in [("scaled_mm", None), ("triton_fp8", "auto"), *fp8_configs]:
                key = f"{kernel}_us" if cfg in (None, "auto") else f"triton_fp8{cfg}"
                try:
                    t = time_graph(_fp8_call(x, own_ws, kernel, cfg))
                    row[key] = [round(1e6 * t, 2), round(size / t / 1e9)]
                except Exception as e:  # tiles the shape or the GPU cannot take: say so
                    row[key] = type(e).__name__
        for cfg in configs if m <= (DECODE_ROWS if fp8 else 8) else []:  # what they serve
            try:
                own = cfg if cfg == "auto" else GemvConfig(*cfg)
                half = x_half and m > 1
                t = time_graph(_gemm_call(name, x.half() if half else x, own_ws, own,
                                          torch.bfloat16 if half else None))
                row[f"triton{cfg}"] = [round(1e6 * t, 2), round(size / t / 1e9)]
            except Exception as e:  # a config the shape cannot tile: say so
                row[f"triton{cfg}"] = type(e).__name__
        print(json.dumps(row), flush=True)


def gemm_shapes(preset: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """A preset's decode GEMMs (n, k): its layers' and the lm_head's, as one of `tp` ranks
    holds them (column-parallel: n / tp; row-parallel: k / tp; KV heads at least one)."""
    c = PRESETS[preset]
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d, inter = h // heads, c["intermediate_size"] // tp
    return {"qkv+rotary": ((heads // tp + 2 * max(1, kv // tp)) * d, h), "o": (h, heads * d // tp),
            "gate_up+silu": (2 * inter, h), "down": (h, inter),
            "lm_head": (c["vocab_size"] // tp, h)}


def gemm_table(configs: list[tuple[int, ...] | str], ms: tuple[int, ...] = (1, 8),
               preset: str = "llama-1b", fp8: bool = False,
               fp8_configs: list[tuple[str, tuple[int, ...]]] = (), block: int = 0,
               tp: int = 1, x_half: bool = False) -> None:
    for name, (n, k) in gemm_shapes(preset, tp).items():
        if (fp8 or block) and name == "lm_head":
            continue  # stays in the model's dtype
        gemm_rows(name, n, k, configs, ms, fp8, fp8_configs, block, x_half)
        torch.cuda.empty_cache()


def attention_row(batch: int, context: int, configs: list[tuple[int, ...]], heads: int = 32,
                  kv_heads: int = 8, head_dim: int = 64, bs: int = 16, sets: int = 4,
                  shared: int = 0, fp8: bool = False) -> dict:
    """The decode attention kernels alone (as a served decode layer runs them: q and the
    new key rotated inside, the splits, the merge if any), replayed in a graph: microseconds
    a call and the KV read rate (GB/s, counting every sequence's keys), per config (keys per
    tile, warps, stages[, splits (0: the default)]; "default": the shipped choice). Each call
    reads its own scattered blocks (`sets` disjoint table sets, as different layers would),
    so small cases do not live in L2. shared > 0: every table of a set starts with the same blocks
    holding `shared` keys (a cached system prompt), and each config is timed without and
    with the cascade ("+cascade")."""
    from raygraph.model.triton_attention import paged_decode_attention

    dt, nb = torch.bfloat16, -(-context // bs)
    if shared // bs * bs > context - 1:
        raise SystemExit(f"a shared prefix of {shared} keys leaves no own key at {context}")
    total = sets * batch * nb
    cache_dt = torch.float8_e4m3fn if fp8 else dt
    kc, vc = (torch.randn(total + 1, bs, kv_heads, head_dim, device="cuda", dtype=dt).to(cache_dt)
              for _ in range(2))
    tables = (torch.randperm(total, device="cuda", dtype=torch.int32) + 1).view(sets, batch, nb)
    tables[:, :, : shared // bs] = tables[:, :1, : shared // bs].clone()
    shared_len = torch.tensor([shared // bs * bs], dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=dt)
    k_new = torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=dt)
    rope = tuple(torch.randn(2, 8192, head_dim // 2, device="cuda"))  # any tables
    kv_bytes = batch * context * kv_heads * head_dim * 2 * kc.element_size()
    row: dict = {"batch": batch, "context": context}
    for cfg in [None, *configs]:
        cfg = cfg or ()
        tiles = cfg[:3] or None
        splits = cfg[3] if len(cfg) > 3 and cfg[3] else None
        for cascade in [False, True] if shared else [False]:

            def call(i: int, tiles=tiles, splits=splits, cascade=cascade) -> torch.Tensor:
                return paged_decode_attention(  # stores the step's K/V, as in a step
                    q, kc, vc, tables[i % sets], lens, head_dim**-0.5, k_new, k_new,
                    tiles=tiles, splits=splits, shared_len=shared_len if cascade else None,
                    rope=rope)

            name = str(cfg or "default") + ("+cascade" if cascade else "")
            try:
                t = time_graph(call)
                row[name] = [round(1e6 * t, 1), round(kv_bytes / t / 1e9)]
            except Exception as e:  # a config the compiler refuses: say so
                row[name] = type(e).__name__
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--cases", nargs="+", default=["1x128", "8x1024"])
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--gemm-only", action="store_true")
    p.add_argument("--gemm-m", type=int, nargs="+", default=[1, 8], help="token rows")
    p.add_argument("--tp", type=int, default=1,
                   help="--gemm-only: the GEMMs as one rank of this tensor-parallel size holds")
    p.add_argument("--gemm-fp8", action="store_true",
                   help="time the Triton configs on FP8 weights (per-row scales)")
    p.add_argument("--gemm-configs", nargs="+", default=None,
                   help="Triton configs to time, each block_n,block_k,num_warps,num_stages, "
                        "or auto (the kernels' own choice for the rows)")
    p.add_argument("--gemm-x-half", action="store_true",
                   help="the Triton configs at 2+ rows take x in float16 standing for bf16 "
                        "(as FP8 layers' norms and gate|up store it for them)")
    p.add_argument("--gemm-block", type=int, default=0, metavar="COLUMNS",
                   help="block-scaled FP8 weights (a scale a row and COLUMNS columns, as "
                        "the 128 x 128 format): past 16 rows the served GEMM against the "
                        "dequantized weight")
    p.add_argument("--fp8-gemm-configs", nargs="+", default=[],
                   help="with --gemm-fp8 (past 8 rows) or --gemm-block: Triton FP8 GEMM tiles "
                        "to time, each block_m,block_n,block_k,num_warps,num_stages[,1: tiles "
                        "through TMA descriptors] (block_k is the group under --gemm-block)")
    p.add_argument("--attention", nargs="*", default=None,
                   metavar="TILE,WARPS,STAGES[,SPLITS]",
                   help="time the decode attention kernel alone over --cases, per config "
                        "(SPLITS 0: the default)")
    p.add_argument("--head-dim", type=int, default=64, help="--attention: the head size")
    p.add_argument("--kv-fp8", action="store_true", help="--attention: an FP8 (e4m3) cache")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="KEYS",
                   help="--attention: every sequence starts with the same cached KEYS keys; "
                        "time each config without and with the cascade")
    add_weight_flags(p, "; the step's profile")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="profile verify steps: each sequence's token and K drafts as rows")
    a = p.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in a.cases]
    if a.attention is not None:
        configs = [tuple(int(v) for v in c.split(",")) for c in a.attention]
        for b, c in cases:
            row = attention_row(b, c, configs, head_dim=a.head_dim, shared=a.shared_prefix,
                                fp8=a.kv_fp8)
            print(json.dumps(row | {"head_dim": a.head_dim, "kv_fp8": a.kv_fp8}), flush=True)
            torch.cuda.empty_cache()
        return
    if not a.skip_gemm:
        configs = ([c if c == "auto" else tuple(int(v) for v in c.split(","))
                    for c in a.gemm_configs]
                   if a.gemm_configs else ["auto", (16, 256, 4, 4), (16, 512, 4, 3),
                                           (32, 256, 4, 4), (64, 128, 4, 4), (32, 128, 4, 6)])
        fp8_configs = [("triton_fp8", tuple(int(v) for v in c.split(",")))
                       for c in a.fp8_gemm_configs]
        gemm_table(configs, tuple(a.gemm_m), a.preset, a.gemm_fp8, fp8_configs, a.gemm_block,
                   a.tp, a.gemm_x_half)
    if a.gemm_only:
        return
    model = bench_model(a.preset, a.load_format)
    rows = 1 + a.verify  # a sequence's decode rows
    w = make_worker(model, "graph", rows * max(b for b, _ in cases),
                    max(c for _, c in cases) + a.verify, 16, load_format=a.load_format,
                    quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
                    speculative=a.verify > 0)
    w.capture_all()
    for b, c in cases:
        for i in range(5):
            w.execute(decode_plan(b, c, 16, i, a.verify))
        print(json.dumps({"batch": b, "context": c, "verify": a.verify,
                          **kernel_table(w, rows * b)}), flush=True)
        print(json.dumps({"batch": b, "context": c, **chain_table(w, rows * b)}), flush=True)
        if a.verify:
            continue  # the host phases below time plain decode steps
        print(json.dumps({"batch": b, "context": c, "host_us": host_phases(w, b, c)}),
              flush=True)
        print(json.dumps({"batch": b, "context": c, **host_timeline(w, b, c)}), flush=True)


if __name__ == "__main__":
    main()
