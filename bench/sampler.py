"""The sampler alone: one step's token choice from [rows, vocab] logits, as the worker calls it
(`sample_tokens` with its pinned staging), for the sampling settings clients send, on one GPU.

    python3 -m bench.sampler [--rows 1 64 256] [--vocab 128256] [--iters 50]

Each case is timed twice: host ms (the call's wall time: what the worker's loop spends before
it can plan the next step) and device ms (CUDA events around the same calls, the time the
step's stream spends). The logits are bf16, as the graphs hand them back. The primitives the
filters are built from (a full sort, top-k, softmax, one noise draw) are timed alongside, so a
case can be read against its parts. To time another tree's sampler, put it first:
`PYTHONPATH=OLD_TREE python3 bench/sampler.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

from raygraph.protocol import SeqChunk
from raygraph.worker.sampler import SamplingRows, sample_tokens

# name -> SeqChunk fields; "llama3.1" is Llama-3.1's generation_config.json
CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "llama3.1 (t 0.6, top_p 0.9)": dict(temperature=0.6, top_p=0.9),
    "top_k 50": dict(temperature=0.7, top_k=50),
    "top_k 50, top_p 0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "seeded, t 0.6, top_p 0.9": dict(temperature=0.6, top_p=0.9, seed=1),
}


def timed(fn, iters: int) -> tuple[float, float]:
    """(host ms a call, device ms a call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / iters
    end.synchronize()
    return host, start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    results = []
    for rows in a.rows:
        logits = (torch.randn(rows, a.vocab, device=dev) * 3).to(torch.bfloat16)
        greedy = logits.argmax(-1)
        staging = SamplingRows(rows, dev)
        for name, kw in CASES.items():
            chunks = [SeqChunk(i, [0], 0, [0], True, num_generated=7, **kw) for i in range(rows)]
            host, device = timed(partial(sample_tokens, logits, chunks, gen, greedy, staging),
                                 a.iters)
            results.append(dict(rows=rows, case=name, host_ms=round(host, 4),
                                device_ms=round(device, 4)))
        wide = logits.float()
        parts = {"sort": partial(wide.sort, dim=-1, descending=True),
                 "sort, bf16": partial(logits.sort, dim=-1, descending=True),
                 "topk 50": partial(wide.topk, 50, dim=-1),
                 "topk 1024": partial(wide.topk, 1024, dim=-1),
                 "softmax": partial(wide.softmax, -1),
                 "noise draw": partial(torch.empty_like(wide).exponential_, generator=gen)}
        for name, fn in parts.items():
            host, device = timed(fn, a.iters)
            results.append(dict(rows=rows, case=f"part: {name}", host_ms=round(host, 4),
                                device_ms=round(device, 4)))
    print("| rows | case | host ms | device ms |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['case']} | {r['host_ms']:.3f} | {r['device_ms']:.3f} |")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
