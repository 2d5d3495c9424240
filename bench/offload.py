"""Weight offload on one GPU: tokens/s and achieved H2D GB/s for budgets of a fraction of the
weights, synchronous copies vs LRU+prefetch vs ring-in-graph, against the PCIe floor
(bytes copied per step / pinned H2D bandwidth measured in the same run), plus the floor
sweep (floor check off: the smallest budget that still gives the all-resident tokens).

    python -m bench.offload [--preset llama-1b] [--fractions 0.25 0.5] [--batch 1]

Prints one JSON line per configuration and a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from bench.checkpoints import make_random_checkpoint
from bench.decode_step import median_replay_s
from raygraph.config import (
    CacheConfig,
    GraphConfig,
    OffloadConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.graph.executor import EagerExecutor
from raygraph.memory.offload_plan import ALIGN, OffloadError, aligned
from raygraph.protocol import BucketKey, SeqChunk, StepPlan
from raygraph.worker.worker import Worker

BS = 16
PROMPT = 16


def pinned_h2d_bandwidth(nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Pinned host -> device bytes per second, one large copy at a time."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return iters * nbytes / (time.perf_counter() - t0)


def make_worker(model: str, offload: OffloadConfig | None, graph: bool, batch: int,
                pool: str = "vmm") -> Worker:
    steps_room = 512
    blocks = batch * -(-(PROMPT + steps_room) // BS)
    cfg = ServeConfig(
        model=model, device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=BS, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT,
                                  max_model_len=PROMPT + steps_room),
        graph=GraphConfig(mode="graph" if graph else "eager", decode_sizes=[batch],
                          prefill_sizes=[batch * PROMPT], pool=pool),
        offload=offload or OffloadConfig(),
    )
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    w.allocate_kv_cache(blocks)
    w.capture_all()
    return w


def greedy(w: Worker, batch: int, steps: int) -> tuple[list[list[int]], list[float]]:
    """A prefill of `batch` fixed prompts, then `steps` decode steps: (tokens, step seconds)."""
    per_seq = -(-(PROMPT + steps + 1) // BS)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[(7 * i + 13 * t) % 1000 + 3 for t in range(PROMPT)] for i in range(batch)]
    res = w.execute(StepPlan(0, [SeqChunk(i, p, 0, tables[i], True)
                                 for i, p in enumerate(prompts)]))
    out = [[t] for t in res.token_ids]
    times = []
    for s in range(steps):
        plan = StepPlan(s + 1, [SeqChunk(i, [out[i][-1]], PROMPT + s, tables[i], True)
                                for i in range(batch)])
        t0 = time.perf_counter()
        res = w.execute(plan)  # ends in a host read of the tokens
        times.append(time.perf_counter() - t0)
        for i, t in enumerate(res.token_ids):
            out[i].append(t)
    return out, times


def replay_ms(w: Worker, batch: int, iters: int = 10) -> float | None:
    """The decode graph's replay alone (no input prep, no sampling), where there is one."""
    runner = getattr(w.executor, "graphs", {}).get(BucketKey("decode", batch))
    if runner is None or runner.graph is None:
        return None
    return round(1e3 * median_replay_s(runner.graph, iters), 3)


def release(w: Worker) -> None:
    """Free a worker's GPU and pinned memory now (hooks and engine form reference cycles);
    graphs go first, before the executor releases their pool."""
    getattr(w.executor, "graphs", {}).clear()
    gc.collect()
    w.shutdown()
    w.__dict__.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def floor_sweep(model: str, mode: str, batch: int, ref: list[list[int]], steps: int,
                pool: str) -> dict:
    """Floor check off: a budget works when load succeeds and the tokens equal the
    all-resident ones. Below one largest weight nothing can run; the computed floor must be
    no lower than the smallest working budget and at most one largest weight above it."""

    def works(budget: int) -> tuple[dict, Worker | None]:
        try:
            cfg = OffloadConfig(budget_bytes=budget, mode=mode, check_floor=False)
            w = make_worker(model, cfg, True, batch, pool)
        except OffloadError as e:
            return {"budget": budget, "tokens_equal": False, "error": str(e)[:120]}, None
        got, want = greedy(w, batch, steps)[0], [r[: steps + 1] for r in ref]
        diff = [s for s in range(steps + 1) if [g[s] for g in got] != [r[s] for r in want]]
        return {"budget": budget, "tokens_equal": not diff,
                "first_diff_step": diff[0] if diff else None}, w

    probe = make_worker(model, OffloadConfig(budget_bytes=1 << 40, mode=mode), True, batch,
                        pool)
    e = probe.offload
    floor, resident = e.floor.bytes, e.resident
    largest = max(aligned(s.nbytes) for s in e.specs)
    release(probe)
    row = {"sweep": mode, "graph_pool": pool, "floor_bytes": floor, "resident_bytes": resident,
           "largest_weight_bytes": largest}
    for name, budget in (("at_floor", floor), ("floor_minus_partner", resident + largest),
                         ("below_largest", resident + largest - ALIGN)):
        row[name], w = works(budget)
        if w is not None:
            release(w)
    smallest = resident + largest if row["floor_minus_partner"]["tokens_equal"] else None
    row["smallest_working_budget"] = smallest
    # below one largest weight the load must refuse (an error, never wrong tokens)
    row["tight_and_safe"] = (smallest is not None and row["at_floor"]["tokens_equal"]
                             and "error" in row["below_largest"]
                             and smallest <= floor <= smallest + largest)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.5])
    p.add_argument("--modes", nargs="+", default=["sync", "lru", "ring", "ring-eager"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--sweep-modes", nargs="*", default=["ring", "lru", "sync"])
    p.add_argument("--graph-pool", choices=["vmm", "torch", "private"], default="vmm")
    a = p.parse_args()
    model = str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
    bw = pinned_h2d_bandwidth()
    print(json.dumps({"pinned_h2d_gbps": round(bw / 1e9, 2)}), flush=True)

    w = make_worker(model, None, True, a.batch, a.graph_pool)
    weight_bytes = sum(p.numel() * p.element_size() for p in w.model.parameters())
    ref, times = greedy(w, a.batch, a.steps)
    t_compute = statistics.median(times[2:])
    resident_replay = replay_ms(w, a.batch)
    release(w)
    print(json.dumps({"all_resident_ms": round(1e3 * t_compute, 3),
                      "all_resident_replay_only_ms": resident_replay,
                      "weight_bytes": weight_bytes}), flush=True)

    rows = []
    for frac in a.fractions:
        budget = int(frac * weight_bytes)
        for mode in a.modes:
            engine_mode, graph = mode.removesuffix("-eager"), not mode.endswith("-eager")
            row = {"fraction": frac, "budget_bytes": budget, "mode": mode}
            try:
                cfg = OffloadConfig(budget_bytes=budget, mode=engine_mode)
                w = make_worker(model, cfg, graph, a.batch, a.graph_pool)
            except OffloadError as e:
                row["error"] = str(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            eager = isinstance(w.executor, EagerExecutor)
            tokens, times = greedy(w, a.batch, a.steps)
            step = statistics.median(times[2:])
            stats = w.offload_stats()
            row["replay_only_ms"] = replay_ms(w, a.batch)
            copied = stats.bytes_per_step
            t_copy = copied / bw
            row.update(
                tokens_equal=tokens == ref, step_ms=round(1e3 * step, 3),
                tokens_per_s=round(a.batch / step, 2),
                copied_mb_per_step=round(copied / 1e6, 1),
                floor_ms=round(1e3 * t_copy, 3),
                pct_of_floor_tps=round(100 * t_copy / step, 1),
                achieved_h2d_gbps=round(copied / step / 1e9, 2),
                pct_of_pinned_bw=round(100 * copied / step / bw, 1),
                # copy time that did not lengthen the step, and the same overlap over the
                # most that could be hidden (the shorter of copy and all-resident step)
                copy_hidden=round((t_compute + t_copy - step) / t_copy, 3),
                overlap_of_possible=round((t_compute + t_copy - step) / min(t_compute, t_copy),
                                          3),
                kept_resident_mb=round(
                    (stats.offloaded_bytes - w.offload.copied_per_step()) / 1e6, 1),
                floor_all_offloaded_ms=round(1e3 * stats.offloaded_bytes / bw, 3),
                hit_rate=round(stats.hit_rate, 3) if engine_mode == "lru" else None,
                # measured by the engine where steps run eagerly (inside graphs it cannot be)
                stall_ms_per_step=(round(1e3 * stats.stall_s / stats.steps, 3)
                                   if eager and stats.stall_s is not None else None),
                floor_bytes=stats.floor_bytes, graph=graph,
            )
            release(w)
            print(json.dumps(row), flush=True)
            rows.append(row)

    sweeps = [floor_sweep(model, m, a.batch, ref, min(a.steps, 8), a.graph_pool)
              for m in a.sweep_modes]
    for s in sweeps:
        print(json.dumps(s), flush=True)

    print(f"\npinned H2D {bw / 1e9:.1f} GB/s; weights {weight_bytes / 1e9:.2f} GB; "
          f"all-resident decode step {1e3 * t_compute:.2f} ms (batch {a.batch})")
    print("| budget | mode | tokens = resident | step ms | tok/s | MB copied/step | floor ms "
          "| % of floor | H2D GB/s | % of pinned BW | overlap of possible | stall ms | hit rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['fraction']:.0%} | {r['mode']} | error: {r['error'][:80]} |")
            continue
        print(f"| {r['fraction']:.0%} | {r['mode']} | {r['tokens_equal']} | {r['step_ms']} | "
              f"{r['tokens_per_s']} | {r['copied_mb_per_step']} | {r['floor_ms']} | "
              f"{r['pct_of_floor_tps']} | {r['achieved_h2d_gbps']} | {r['pct_of_pinned_bw']} | "
              f"{r['overlap_of_possible']} | {r['stall_ms_per_step']} | {r['hit_rate']} |")


if __name__ == "__main__":
    main()
