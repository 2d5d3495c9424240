"""MoE expert compute: dense (every local expert on every token, zero-weighted where not
routed) vs grouped (sort the token-expert pairs, one grouped GEMM per projection), as the
EP block runs them: on the ep * C gathered rows, with this rank's share of the experts.

    python -m bench.moe_experts [--device cpu|cuda] [--dtype float32|bfloat16]

Prints one JSON line per row count and a markdown table (ms per call, median of --iters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from raygraph.model.moe import experts_dense, experts_grouped


def timed(fn, args: tuple, iters: int, device: torch.device) -> float:
    for _ in range(2):
        fn(*args)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8, help="experts on this rank")
    p.add_argument("--ep", type=int, default=2, help="EP ranks (others' experts: sentinel)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    gate_up = torch.randn(a.experts, 2 * a.inter, a.hidden, device=device, dtype=dtype) * 0.02
    down = torch.randn(a.experts, a.hidden, a.inter, device=device, dtype=dtype) * 0.02
    rows = []
    for n in a.rows:
        x = torch.randn(n, a.hidden, device=device, dtype=dtype)
        ids = torch.rand(n, a.experts * a.ep, device=device).topk(a.top_k, dim=-1).indices
        local = ids.masked_fill(ids >= a.experts, a.experts)  # rank 0 of ep: ids < experts
        scores = torch.rand(n, a.top_k, device=device)
        row = {"rows": n, "device": a.device, "dtype": a.dtype}
        args = (x, gate_up, down, local, scores)
        for impl in (experts_dense, experts_grouped):
            row[impl.__name__] = round(timed(impl, args, a.iters, device), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nE_local={a.experts} ep={a.ep} k={a.top_k} H={a.hidden} I={a.inter}\n")
    print("| rows | dense ms | grouped ms |\n|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['experts_dense']} | {r['experts_grouped']} |")


if __name__ == "__main__":
    main()
