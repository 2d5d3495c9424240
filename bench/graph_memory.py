"""Device memory taken by capturing the full default schedule, per graph pool, on one GPU.

    python -m bench.graph_memory [--preset llama-1b] [--max-decode 256] [--max-prefill 2048]

Pools: (a) `private` (a torch pool per capture), (b) `torch` (one shared pool, captured
largest first), (c) `vmm` (a virtual range per capture over shared physical chunks, capped
at the budget the worker measures before sizing the KV cache). Also: the largest single
capture alone, capture time, replay latency (b) vs (c) interleaved, sleep/wake of (c) with
every graph's output compared bitwise before sleep and after wake. One JSON line per
figure, then a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import torch

from bench.checkpoints import make_random_checkpoint
from raygraph.config import CacheConfig, GraphConfig, SchedulerConfig, ServeConfig
from raygraph.graph.executor import GraphExecutor
from raygraph.graph.runners import FullGraph
from raygraph.protocol import BucketKey
from raygraph.worker import sizing
from raygraph.worker.worker import Worker

MiB = 2**20


def device_used() -> int:
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def capture(w: Worker, pool: str, budget: int | None, keys: list[BucketKey] | None = None):
    """A fresh executor over the worker's model and KV cache; captures `keys` (default: the
    whole schedule). Returns it with its figures."""
    before = device_used()
    ex = w._make_executor(budget, pool)
    t0 = time.perf_counter()
    for key in keys or ex.schedule():
        ex.capture(key)
    seconds = time.perf_counter() - t0
    taken = device_used() - before
    st = ex.pool.stats()
    largest = max(st.capture_bytes.items(), key=lambda kv: kv[1])
    return ex, {
        "pool": pool, "buckets": len(ex.graphs),
        "graphs": sum(r.num_pieces for r in ex.graphs.values()),
        "capture_s": round(seconds, 2), "device_taken_mib": round(taken / MiB, 1),
        "pool_held_mib": round(st.held_bytes / MiB, 1),
        "input_buffers_mib": round(ex.input_buffer_bytes / MiB, 1),
        "virtual_mib": round(st.virtual_bytes / MiB, 1), "spaces": st.spaces,
        "largest_capture": largest[0], "largest_capture_mib": round(largest[1] / MiB, 1),
        "budget_mib": None if st.budget_bytes is None else round(st.budget_bytes / MiB, 1),
    }


def replay(runner) -> torch.Tensor:
    """One replay on the capture batch; its logits (decode) or hidden states (prefill)."""
    if isinstance(runner, FullGraph):
        return runner.run(runner.md)[0]
    return runner.run(runner.md, runner.md.slot_mapping.shape[0])


def replay_ms(runner, iters: int) -> float:
    """Median of CUDA-event timed replays (piecewise: pieces and eager attention)."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay(runner)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def release(ex: GraphExecutor) -> None:
    ex.release()
    gc.collect()
    torch.cuda.empty_cache()


def make_worker(a: argparse.Namespace) -> Worker:
    model = str(make_random_checkpoint(f"/tmp/raygraph-bench/{a.preset}", a.preset))
    cfg = ServeConfig(
        model=model, device="cuda", dtype="bfloat16",
        cache=CacheConfig(block_size=16, num_blocks=2048),
        scheduler=SchedulerConfig(max_num_seqs=a.max_decode, max_num_batched_tokens=a.max_prefill,
                                  max_model_len=4096),
        graph=GraphConfig(pool="vmm", max_decode=a.max_decode, max_prefill=a.max_prefill),
    )
    w = Worker(cfg, 0)
    w.load(("127.0.0.1", 0))
    t0 = time.perf_counter()
    graph_bytes = sizing.graph_bytes(w)  # what load() subtracts before sizing the KV cache
    emit({"part": "budget", "budget_mib": round(w.graph_budget / MiB, 1),
          "graph_bytes_mib": round(graph_bytes / MiB, 1),
          "budget_measure_s": round(time.perf_counter() - t0, 2)})
    w.allocate_kv_cache(2048)
    w.executor.release()  # the benchmark builds its own executors
    return w


def finish(ex: GraphExecutor, row: dict) -> None:
    """Release and report whether torch gave every VMM segment back."""
    vmm = getattr(ex.pool, "vmm", None)
    release(ex)
    if vmm is not None:
        row["leftover_segments"] = vmm.live_allocations
    emit(row)


def part_alone(a: argparse.Namespace, w: Worker) -> None:
    keys = w.executor.schedule()
    for ph in ("decode", "prefill"):
        key = max((k for k in keys if k.phase == ph), key=lambda k: k.num_tokens)
        for pool in ("private", "vmm"):
            ex, row = capture(w, pool, None, [key])
            finish(ex, {"part": "alone", "pool": pool, "key": row["largest_capture"],
                        "pool_held_mib": row["pool_held_mib"]})


def part_private(a: argparse.Namespace, w: Worker) -> None:
    ex, row = capture(w, "private", None)
    finish(ex, {"part": "private", **row})


def part_shared(a: argparse.Namespace, w: Worker) -> None:
    """(b) and (c) in one process, so their replays can be timed interleaved."""
    ex_b, row_b = capture(w, "torch", None)
    ex_c, row_c = capture(w, "vmm", w.graph_budget)
    emit({"part": "torch", **row_b})
    emit({"part": "vmm", **row_c})
    for key in [BucketKey("decode", n) for n in (1, 32, a.max_decode)] + [
            BucketKey("prefill", n) for n in (512, a.max_prefill)]:
        tb, tc = [], []
        for r in (ex_b.graphs[key], ex_c.graphs[key]):
            replay_ms(r, 5)  # warm
        for _ in range(a.rounds):
            tb.append(replay_ms(ex_b.graphs[key], a.iters))
            tc.append(replay_ms(ex_c.graphs[key], a.iters))
        b, c = statistics.median(tb), statistics.median(tc)
        emit({"part": "latency", "key": f"{key.phase}:{key.num_tokens}", "torch_ms": round(b, 4),
              "vmm_ms": round(c, 4), "vmm_vs_torch": round(c / b - 1, 4)})
    release(ex_b)

    # sleep / wake of (c): memory released, every graph replays bitwise as before sleep
    before = {k: replay(r).clone() for k, r in ex_c.graphs.items()}
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    ex_c.sleep()
    sleep_s = time.perf_counter() - t0
    free1, _ = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    ex_c.wake_up()
    wake_s = time.perf_counter() - t0
    free2, _ = torch.cuda.mem_get_info()
    same = sum(torch.equal(replay(r), before[k]) for k, r in ex_c.graphs.items())
    finish(ex_c, {"part": "sleep_wake", "sleep_s": round(sleep_s, 4), "wake_s": round(wake_s, 4),
                  "released_mib": round((free1 - free0) / MiB, 1),
                  "retaken_mib": round((free1 - free2) / MiB, 1),
                  "graphs_exact_after_wake": f"{same}/{len(before)}",
                  "chunks": ex_c.pool.stats().chunks,
                  "mappings": sum(sp.mapped for sp in ex_c.pool.vmm._spaces)})


PARTS = {"alone": part_alone, "private": part_private, "shared": part_shared}


def summarize(rows: list[dict]) -> None:
    by = {r["part"]: r for r in rows}
    alone = {r["pool"]: [] for r in rows if r["part"] == "alone"}
    for r in rows:
        if r["part"] == "alone":
            alone[r["pool"]].append(r["pool_held_mib"])
    lat = [r for r in rows if r["part"] == "latency"]
    va, vb, vc, sw = (by.get(k) for k in ("private", "torch", "vmm", "sleep_wake"))
    print("\n| pool | buckets | graphs | capture s | pool MiB | device taken MiB |")
    print("|---|---|---|---|---|---|")
    for name, r in (("(a) private per capture", va), ("(b) torch shared", vb), ("(c) vmm", vc)):
        if r:
            print(f"| {name} | {r['buckets']} | {r['graphs']} | {r['capture_s']} | "
                  f"{r['pool_held_mib']} | {r['device_taken_mib']} |")
    largest = max(alone.get("private", [0]))
    print(f"| largest single capture alone (torch pool / vmm) | 1 | | | {largest} / "
          f"{max(alone.get('vmm', [0]))} | |")
    print("\n| key | torch shared ms | vmm ms | vmm vs torch |\n|---|---|---|---|")
    for r in lat:
        print(f"| {r['key']} | {r['torch_ms']} | {r['vmm_ms']} | {100 * r['vmm_vs_torch']:+.2f}% |")
    if vb and vc and sw:
        emit({"targets": {
            "vmm_physical_le_1.1x_largest_alone": vc["pool_held_mib"] <= 1.1 * largest,
            "vmm_below_torch_shared": vc["pool_held_mib"] < vb["pool_held_mib"],
            "capture_time_within_1.2x_of_torch": vc["capture_s"] <= 1.2 * vb["capture_s"],
            "replay_within_3pct": all(abs(r["vmm_vs_torch"]) <= 0.03 for r in lat),
            "wake_under_1s": sw["wake_s"] < 1.0,
        }})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--max-decode", type=int, default=256)
    p.add_argument("--max-prefill", type=int, default=2048)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--part", choices=sorted(PARTS), default=None,
                   help="run one part here; default: every part, each in a fresh process so "
                        "one pool's leftovers cannot skew the next one's figures")
    a = p.parse_args()
    if a.part:
        PARTS[a.part](a, make_worker(a))
        return
    rows = []
    for part in PARTS:
        args = [sys.executable, "-m", "bench.graph_memory", "--part", part, "--preset", a.preset,
                "--max-decode", str(a.max_decode), "--max-prefill", str(a.max_prefill),
                "--iters", str(a.iters), "--rounds", str(a.rounds)]
        out = subprocess.run(args, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                print(line, flush=True)
                rows.append(json.loads(line))
        if out.returncode:
            print(f"part {part} failed ({out.returncode}):\n{out.stderr[-3000:]}", flush=True)
    summarize(rows)


if __name__ == "__main__":
    main()
