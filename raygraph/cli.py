"""`raygraph demo | serve | generate | stop`."""

from __future__ import annotations

import argparse
import os
import sys
import time

import msgspec

from raygraph.config import (
    CacheConfig,
    ConfigError,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    load_toml,
    parse_bytes,
)
from raygraph.protocol import SamplingParams

DEMO_PROMPTS = ["The import statement", "A class definition", "The for statement",
                "Exceptions can be raised"]


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in model)")
    p.add_argument("--config", default=None, help="a TOML ServeConfig; flags override it")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=None,
                   help="attention data-parallel groups (MoE models; needs --ep tp*dp)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size: 1 (experts TP-split) or tp*dp (MoE models)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--eager", action="store_true",
                   help="run every step eagerly (no graphs): the reference path, for debugging")
    p.add_argument("--graph-pool", choices=["vmm", "torch", "private"], default=None,
                   help="graph memory: vmm (a virtual range per capture over shared physical "
                        "memory; default), torch (one shared pool), private (a pool per graph)")
    p.add_argument("--offload-budget", type=parse_bytes, default=None,
                   help="keep weights in host memory with at most this much of them on the GPU "
                        "(bytes, or e.g. 1.5GiB, 800MB); fails at load below the floor")
    p.add_argument("--offload-mode", choices=["ring", "lru", "sync"], default=None,
                   help="ring: fixed slots, copies inside the graphs (default); lru: capped "
                        "pool with LRU and prefetch (eager); sync: copy before each kernel")


def serve_config(a: argparse.Namespace) -> ServeConfig:
    cfg = load_toml(a.config) if a.config else ServeConfig()

    def pick(value, default):
        return default if value is None else value

    c, s = cfg.cache, cfg.scheduler
    return msgspec.structs.replace(
        cfg,
        model=os.path.abspath(a.model) if a.model else cfg.model,
        device=pick(a.device, cfg.device),
        dtype=pick(a.dtype, cfg.dtype),
        parallel=ParallelConfig(tp=pick(a.tp, cfg.parallel.tp), dp=pick(a.dp, cfg.parallel.dp),
                                ep=pick(a.ep, cfg.parallel.ep)),
        graph=msgspec.structs.replace(cfg.graph, mode="eager" if a.eager else cfg.graph.mode,
                                      pool=pick(a.graph_pool, cfg.graph.pool)),
        cache=CacheConfig(
            block_size=pick(a.block_size, c.block_size),
            num_blocks=pick(a.num_kv_blocks, c.num_blocks),
            kv_cache_bytes=c.kv_cache_bytes, gpu_memory_utilization=c.gpu_memory_utilization,
            cpu_kv_cache_bytes=c.cpu_kv_cache_bytes,
        ),
        offload=msgspec.structs.replace(
            cfg.offload, budget_bytes=pick(a.offload_budget, cfg.offload.budget_bytes),
            mode=pick(a.offload_mode, cfg.offload.mode)),
        scheduler=SchedulerConfig(
            max_num_seqs=pick(a.max_num_seqs, s.max_num_seqs),
            max_num_batched_tokens=pick(a.max_num_batched_tokens, s.max_num_batched_tokens),
            max_model_len=pick(a.max_model_len, s.max_model_len),
        ),
    )


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, namespace="raygraph")
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, namespace="raygraph")


def cmd_demo(a: argparse.Namespace) -> int:
    import ray

    from raygraph.cluster.coordinator import start_coordinator

    cfg = serve_config(a)
    init_ray(None, num_cpus=max(2, cfg.parallel.world_size + 1))
    t0 = time.perf_counter()
    coord = start_coordinator(cfg)
    print(f"serving {cfg.model} (tp={cfg.parallel.tp}) after {time.perf_counter() - t0:.1f}s")
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=0)
    t0 = time.perf_counter()
    results = ray.get(coord.generate.remote(DEMO_PROMPTS, params))
    dt = time.perf_counter() - t0
    for prompt, r in zip(DEMO_PROMPTS, results):
        print(f"\n>>> {prompt}\n{prompt}{r.text}")
    n = sum(len(r.token_ids) for r in results)
    print(f"\n{len(results)} requests, {n} tokens in {dt:.2f}s ({n / dt:.0f} tokens/s)")
    ray.get(coord.shutdown.remote())
    ray.shutdown()
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from raygraph.cluster.coordinator import start_coordinator

    cfg = serve_config(a)
    init_ray(a.address, num_cpus=None if a.address else cfg.parallel.world_size + 1)
    coord = start_coordinator(cfg, detached=a.detach)
    print(f"coordinator {cfg.coordinator_name!r} serving {cfg.model}", flush=True)
    if a.detach:
        return 0
    import ray

    try:
        while True:
            time.sleep(10)
            ray.get(coord.ping.remote())
    except KeyboardInterrupt:
        ray.get(coord.shutdown.remote())
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    import ray

    from raygraph.cluster.coordinator import get_coordinator

    init_ray(a.address or "auto")
    coord = get_coordinator()
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    if a.stream:
        print(a.prompt, end="", flush=True)
        for ref in coord.generate_stream.options(num_returns="streaming").remote(a.prompt, params):
            print(ray.get(ref).text or "", end="", flush=True)
        print()
        return 0
    (r,) = ray.get(coord.generate.remote(a.prompt, params))
    print(a.prompt + (r.text if r.text is not None else str(r.token_ids)))
    return 0


def cmd_check_capture(a: argparse.Namespace) -> int:
    """Run the capture schedule in lockstep on a local cluster, print the per-key table and
    exit non-zero if any key's records disagree (or a rank fails)."""
    import ray

    from raygraph.cluster.coordinator import start_coordinator
    from raygraph.cluster.lockstep import format_table, last_line

    cfg = serve_config(a)
    cfg = msgspec.structs.replace(
        cfg, graph=msgspec.structs.replace(cfg.graph, mode="graph", capture_at_start=False))
    init_ray(a.address, num_cpus=None if a.address else cfg.parallel.world_size + 1)
    coord = start_coordinator(cfg)
    t0 = time.perf_counter()
    failure = None
    try:
        ray.get(coord.capture_schedule.remote())
    except Exception as e:  # CaptureError, wrapped by Ray
        failure = last_line(e)
    reports = ray.get(coord.capture_report.remote())
    print(format_table(reports))
    print(f"\n{len(reports)} keys on {cfg.parallel.world_size} rank(s) in "
          f"{time.perf_counter() - t0:.1f}s")
    ray.get(coord.shutdown.remote())
    if failure or not all(r.agree for r in reports):
        print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    print("all ranks agree on every key")
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    import ray

    from raygraph.cluster.coordinator import get_coordinator

    init_ray(a.address or "auto")
    coord = get_coordinator()
    ray.get(coord.shutdown.remote())
    ray.kill(coord)
    print("coordinator stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raygraph", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="serve the built-in model locally and generate")
    add_serve_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--temperature", type=float, default=0.0)
    serve = sub.add_parser("serve", help="start the named coordinator on a Ray cluster")
    add_serve_args(serve)
    serve.add_argument("--address", default=None, help="Ray address to join ('auto' for local)")
    serve.add_argument("--detach", action="store_true", help="leave it running and exit")
    gen = sub.add_parser("generate", help="a client: send a prompt to the running coordinator")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=None)
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stream", action="store_true")
    check = sub.add_parser("check-capture",
                           help="capture the schedule in lockstep and check the ranks agree")
    add_serve_args(check)
    check.add_argument("--address", default=None, help="Ray address to join (default: local)")
    stop = sub.add_parser("stop", help="shut the named coordinator down")
    stop.add_argument("--address", default=None)
    a = parser.parse_args(argv)
    handlers = {"demo": cmd_demo, "serve": cmd_serve, "generate": cmd_generate,
                "check-capture": cmd_check_capture, "stop": cmd_stop}
    try:
        return handlers[a.cmd](a)
    except ConfigError as e:  # an impossible layout or setting: say why, no traceback
        print(f"raygraph: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
