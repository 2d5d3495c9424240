"""What a client of the served path sees, against the same work run in-process without Ray.

Per batch size: `batch` concurrent greedy requests (random token prompts, ignore_eos) through
`coordinator.generate`, and the same requests through the coordinator's step logic
(EngineCore) driving a Worker in this process.
ratio = served ms per step / in-process ms per step: what Ray, the coordinator's loop and its
messages add to each step. Also the msgpack size and codec time of the StepDeltas, and the
inter-token gap a batch-1 `generate_stream` client sees.

    python -m bench.serving [--batches 1 8 64 256] [--prompt-len 8] [--max-tokens 256]
                            [--repeats 1]
                            [--model DIR | --preset llama-1b] [--tp N] [--device auto|cpu|cuda]
                            [--load-format dummy]

The in-process phase runs first and frees its memory before Ray starts, so the two never
share the device. With --tp > 1 there is no in-process engine: engine_ms_per_step is the
coordinator's `worker_step_ms` (rank 0's device time per step on GPU, its time in the step on
CPU), see engine_source.

Load mode (any of --request-rate, --num-prompts, --endpoint; bench/load.py says what it
measures): a Poisson stream of streaming requests, reported like `vllm bench serve`.

    python -m bench.serving --request-rate 8 --num-prompts 200 --input-len 512 --output-len 128
                            [--range-ratio 0.5] [--seed 0] [--max-num-seqs 64] [--json-out F]
                            [--shared-prefix-len 1024] [--no-prefix-caching]
                            [--no-decode-cascade]
                            [--endpoint http://HOST:PORT]

It starts a coordinator sized for the load (max_num_seqs, max_num_batched_tokens 2048 unless
given, KV blocks profiled on GPU and pinned on CPU), or with --endpoint sends the same load to
an OpenAI-compatible server (the model's config still gives the vocabulary). A few short
requests run first, untimed, so shapes first seen at run time are not captured in the timing.
--shared-prefix-len N starts every prompt with one random N-token prefix (then --input-len
tokens of its own); the result has the prefix cache's hit rate over the timed requests.
--no-prefix-caching (both modes) turns the coordinator's prefix cache off.
--load-format dummy (both modes): random weights drawn on the device; with --preset only the
preset's config.json is written (e.g. --preset llama3-70b --tp 8, nothing on disk to load).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time

import msgspec
import ray
import torch

from bench import load
from bench.checkpoints import add_weight_flags, bench_model
from raygraph.client.connect import connect, start_coordinator
from raygraph.config import (
    DEFAULT_MODEL,
    CacheConfig,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from raygraph.engine.core import Dispatch, EngineCore, local_dispatch, run_to_completion
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams, StepDelta, StepOutput
from raygraph.serve_options import speculative
from raygraph.worker.worker import Worker

Prompts = list[list[int]]
BLOCK = 16  # KV block size (tokens)


def serve_cfg(a: argparse.Namespace, model: str, num_blocks: int | None, max_num_seqs: int,
              max_num_batched_tokens: int) -> ServeConfig:
    """The coordinator's config from the flags, resolved as start_coordinator would."""
    cfg = ServeConfig(
        model=model, device=a.device, load_format=a.load_format, quantization=a.quantization,
        parallel=ParallelConfig(tp=a.tp),
        replica=ReplicaConfig(replicas=a.replicas, routing=a.routing),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                          enable_prefix_caching=not a.no_prefix_caching,
                          cache_dtype=a.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens),
        # decode graphs for every batch the engine may run (past 256 sequences too)
        graph=GraphConfig(mode=a.mode, prefill_graph=a.prefill_graph, capture=a.capture,
                          decode_cascade=a.decode_cascade,
                          max_decode=max(GraphConfig().max_decode, max_num_seqs)),
        speculative=speculative(a.speculative_config or "{}"),
    )
    return cfg.resolved(torch.cuda.device_count())


def make_cfg(a: argparse.Namespace, model: str) -> ServeConfig:
    """One config for both phases. The KV block count is pinned (the largest batch at full
    length, plus a margin) so neither phase profiles memory and both run with the same pool."""
    top = max(a.batches)
    blocks = top * -(-(a.prompt_len + a.max_tokens) // BLOCK) + 16
    return serve_cfg(a, model, blocks, top,
                     a.max_num_batched_tokens or max(512, top * a.prompt_len))


def load_cfg(a: argparse.Namespace, model: str, max_len: int) -> ServeConfig:
    """Sized by the load. On GPU the coordinator profiles memory for the KV cache (unless
    --num-kv-blocks pins it, so a cache holds fewer prefixes); on CPU the block count is
    pinned: every sequence that can run at once at the longest length."""
    cfg = serve_cfg(a, model, a.num_kv_blocks, a.max_num_seqs, a.max_num_batched_tokens)
    if cfg.device != "cpu" or a.num_kv_blocks:
        return cfg
    blocks = min(a.num_prompts, a.max_num_seqs) * -(-max_len // BLOCK) + 16
    return msgspec.structs.replace(cfg, cache=msgspec.structs.replace(cfg.cache,
                                                                      num_blocks=blocks))


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int | str | None = None
                 ) -> Prompts:
    """Random token ids, seeded by batch size (or `seed`): both phases see the same prompts.
    Warm-ups take prompts of their own: a timed prompt seen before would hit the prefix
    cache in the served phase (a fresh engine in process)."""
    rng = random.Random(batch if seed is None else seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def sampling(a: argparse.Namespace) -> tuple[SamplingParams, SamplingParams]:
    """(the timed requests' params, the warm-up's). With a temperature, requests are seeded:
    their draws then do not depend on the batch, and both phases give the same tokens."""
    kw = dict(ignore_eos=True, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
              seed=0 if a.temperature > 0 and not a.unseeded else None)
    return (SamplingParams(max_tokens=a.max_tokens, **kw),
            SamplingParams(max_tokens=min(4, a.max_tokens), **kw))


def run_engine(cfg: ServeConfig, prompts: Prompts, params: SamplingParams,
               dispatch: Dispatch) -> dict:
    """The coordinator's step loop (EngineCore: schedule, deltas, tokens one step late) in
    this process, against a Worker called directly: everything the served path does except
    Ray. The deltas are kept to time their msgpack round trip afterwards."""
    core = EngineCore.from_config(cfg, ModelConfig.from_pretrained(cfg.model),
                                  cfg.cache.num_blocks or 0)
    (sched,) = core.schedulers
    seqs = [Sequence(i, p, params) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    sent: list[bytes] = []

    def keep(msgs: list[bytes]) -> list[StepOutput]:
        sent.extend(m for m in msgs if m)
        return dispatch(msgs)

    t0 = time.perf_counter()
    run_to_completion(core, keep)
    seconds = time.perf_counter() - t0
    dec, enc = msgspec.msgpack.Decoder(StepDelta), msgspec.msgpack.Encoder()
    t1 = time.perf_counter()
    deltas = [dec.decode(m) for m in sent]
    t2 = time.perf_counter()
    for d in deltas:
        enc.encode(d)
    t3 = time.perf_counter()
    steps = len(sent)
    return {"steps": steps, "seconds": seconds,
            "decode_steps": sum(not d.chunks for d in deltas),
            "msg_bytes_per_step": round(sum(len(m) for m in sent) / steps),
            "encode_us_per_step": round(1e6 * (t3 - t2) / steps, 2),
            "decode_us_per_step": round(1e6 * (t2 - t1) / steps, 2),
            "tokens": [seq.output_token_ids for seq in seqs]}


def engine_phase(cfg: ServeConfig, a: argparse.Namespace, vocab: int) -> dict[int, dict]:
    """Per batch, the in-process run (tp 1: a Worker built as the coordinator builds it; tp > 1:
    the scheduler alone with dummy tokens, for the message figures), without speculation.
    Frees the device after."""
    params, warm = sampling(a)
    cfg = msgspec.structs.replace(cfg, speculative=SpeculativeConfig())
    if cfg.parallel.world_size > 1:  # the message figures only: a fake, pipelined worker
        dec, pending = msgspec.msgpack.Decoder(StepDelta), [0]

        def fake(msgs: list[bytes]) -> list[StepOutput]:
            (msg,) = msgs
            d = dec.decode(msg) if msg else None
            out, pending[0] = pending[0], (len(d.feed) + sum(c.sample for c in d.chunks)
                                           if d else 0)
            return [StepOutput(0, [3] * out)]
        return {b: run_engine(cfg, make_prompts(b, a.prompt_len, vocab), params, fake)
                for b in a.batches}
    worker = Worker(cfg, 0)
    worker.load(("127.0.0.1", 0))
    worker.allocate_kv_cache(cfg.cache.num_blocks or 0)
    worker.capture_all()  # what the coordinator's start-up schedule captures
    execute = local_dispatch(worker)

    rows = {}
    for b in a.batches:
        prompts = make_prompts(b, a.prompt_len, vocab)
        run_engine(cfg, prompts, warm, execute)  # keys first seen at run time are captured
        rows[b] = run_engine(cfg, prompts, params, execute)
    worker.shutdown()
    worker = None  # the closure in execute holds it: drop both before freeing the device
    del execute
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def served_run(coord: ray.actor.ActorHandle, prompts: Prompts, params: SamplingParams
               ) -> dict:
    """One generate call carrying every prompt, so all arrive in the same step, as in-process.
    Steps and rank 0's time inside Worker.execute are deltas of the coordinator's stats."""
    before = ray.get(coord.stats.remote())
    t0 = time.perf_counter()
    results = ray.get(coord.generate.remote(prompts, params))
    wall = time.perf_counter() - t0
    after = ray.get(coord.stats.remote())
    steps = after["steps"] - before["steps"]
    worker_ms = (after["worker_step_ms"] * after["steps"]
                 - before["worker_step_ms"] * before["steps"]) / steps
    idle_ms = (after["device_idle_ms_per_step"] * after["steps"]
               - before["device_idle_ms_per_step"] * before["steps"]) / steps
    host_ms = (after["loop_host_ms_per_step"] * after["steps"]
               - before["loop_host_ms_per_step"] * before["steps"]) / steps
    sched_ms = (after["schedule_update_ms_per_step"] * after["steps"]
                - before["schedule_update_ms_per_step"] * before["steps"]) / steps
    started = after["requests_started"] - before["requests_started"]
    ttft_ms = (after["mean_ttft_ms"] * after["requests_started"]
               - before["mean_ttft_ms"] * before["requests_started"]) / max(1, started)
    return {"seconds": wall, "steps": steps, "worker_ms": worker_ms, "idle_ms": idle_ms,
            "ttft_ms": ttft_ms,
            "loop_waits": after["spec_loop_waits"] - before["spec_loop_waits"],
            "loop_declined": after["spec_loop_declined"] - before["spec_loop_declined"],
            "turnaround_ms": after["spec_loop_turnaround_ms"],
            "sched_ms": sched_ms,
            "host_ms": host_ms,
            "tokens": [r.token_ids for r in results]}


def stream_gaps(coord: ray.actor.ActorHandle, prompt: list[int], params: SamplingParams
                ) -> tuple[float, float]:
    """(time to the first delta, median gap between deltas) in ms, as a streaming client sees
    them; the first delta carries the prefill, so it opens the gaps but is not one."""
    t0 = time.perf_counter()
    arrivals = []
    for ref in coord.generate_stream.options(num_returns="streaming").remote(prompt, params):
        ray.get(ref)
        arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return 1e3 * (arrivals[0] - t0), 1e3 * statistics.median(gaps) if gaps else float("nan")


def served_steps(before: dict, after: dict) -> dict:
    """The coordinator's steps over the warm-up and the timed load (stats() before and after):
    how many, by phase, and the per-step figures of stats() over those steps."""
    steps = after["steps"] - before["steps"]
    phases = {k: v - before["steps_by_phase"].get(k, 0)
              for k, v in after["steps_by_phase"].items()}

    def per_step(key: str) -> float:  # stats() gives means since start: back out the window
        return round((after[key] * after["steps"] - before[key] * before["steps"])
                     / max(1, steps), 3)

    # rank 0's device time a step, by its key's phase (decode; prefill, with any decode
    # rows beside the prompts; eager)
    by_phase = {}
    for k, n in after["device_steps_by_phase"].items():
        n -= before["device_steps_by_phase"].get(k, 0)
        if n:
            sec = after["device_s_by_phase"][k] - before["device_s_by_phase"].get(k, 0.0)
            by_phase[k] = {"steps": n, "ms": round(1e3 * sec / n, 3)}
    return {"served_steps": steps, "served_steps_by_phase": phases,
            "served_worker_ms_by_phase": by_phase,
            "served_worker_step_ms": per_step("worker_step_ms"),
            "served_device_idle_ms_per_step": per_step("device_idle_ms_per_step"),
            "served_loop_host_ms_per_step": per_step("loop_host_ms_per_step"),
            "preemptions": after["preemptions"] - before["preemptions"]}


def load_main(a: argparse.Namespace, model: str, name: str) -> None:
    """Load mode: bench/load.py's workload through the coordinator (Ray) or --endpoint (HTTP);
    the table to stderr, one JSON line to stdout (and --json-out)."""
    load.fill_load_defaults(a)
    m = ModelConfig.from_pretrained(model)
    reqs = load.make_requests(a, m.vocab_size)
    longest = max(len(r.prompt) + r.params.max_tokens for r in reqs)
    if longest > m.max_position_embeddings:
        raise SystemExit(f"a request needs {longest} positions; {name} has "
                         f"{m.max_position_embeddings}: lower --input-len/--output-len")
    warmup = load.warmup_requests(reqs, m.vocab_size, a.seed)
    arrivals = load.arrival_times(a.num_prompts, a.request_rate, a.seed)
    if a.endpoint:
        row = asyncio.run(load.benchmark_http(a.endpoint, name, reqs, warmup, arrivals,
                                              a.max_concurrency))
        where: dict = {"client": "http", "endpoint": a.endpoint, "device": None, "dtype": None}
    else:
        connect(None, log_to_driver=False)
        cfg = load_cfg(a, model, longest)
        coord = start_coordinator(cfg)
        client = load.ray_client(coord) if a.client == "ray" else load.mux_client(coord)
        before = ray.get(coord.stats.remote())
        row = asyncio.run(load.benchmark(client, reqs, warmup, arrivals, a.max_concurrency,
                                         load.coordinator_counters(coord)))
        after = ray.get(coord.stats.remote())
        row |= served_steps(before, after)
        # output tokens per replica over the warm-up and the load: the routing's balance
        row["replica_output_tokens"] = [
            r.get("generation_tokens", 0) - b.get("generation_tokens", 0)
            for r, b in zip(after["replicas"], before["replicas"])]
        ray.get(coord.shutdown.remote())
        where = {"client": a.client, "device": cfg.device, "dtype": cfg.dtype}
    row["request_rate"] = str(a.request_rate)  # "inf" stays valid JSON
    print(load.format_table(row), file=sys.stderr, flush=True)
    row |= where | {"model": name, "tp": a.tp, "quantization": a.quantization,
                    "kv_cache_dtype": a.kv_cache_dtype,
                    "replicas": a.replicas, "routing": a.routing,
                    "mode": a.mode, "prefill_graph": a.prefill_graph,
                    "num_prompts": a.num_prompts, "max_concurrency": a.max_concurrency,
                    "input_len": a.input_len, "output_len": a.output_len,
                    "shared_prefix_len": a.shared_prefix_len, "num_prefixes": a.num_prefixes,
                    "prefix_caching": None if a.endpoint else not a.no_prefix_caching,
                    "decode_cascade": None if a.endpoint else a.decode_cascade,
                    "range_ratio": a.range_ratio, "seed": a.seed, "max_num_seqs": a.max_num_seqs,
                    "max_num_batched_tokens": a.max_num_batched_tokens,
                    "temperature": a.temperature, "top_k": a.top_k,
                    "top_p": a.top_p, "seeded": a.temperature > 0 and not a.unseeded}
    line = json.dumps(row)
    print(line, flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(line + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="random-weight checkpoint (bench/checkpoints.py)")
    add_weight_flags(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="the served engine's speculative decoding, as `raygraph serve` takes "
                        "it (the in-process engine phase runs without)")
    p.add_argument("--replicas", type=int, default=1,
                   help="engines behind the coordinator (load mode; use --client mux)")
    p.add_argument("--routing", choices=["cache", "load", "round-robin"], default="cache")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="load mode: KV blocks per replica (default: profiled on GPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1,
                   help="served runs per batch; the one of median time is reported")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: max(512, largest batch x prompt length); load mode 2048")
    p.add_argument("--mode", choices=["graph", "eager"], default="graph")
    p.add_argument("--prefill-graph", choices=["piecewise", "full"],
                   default=GraphConfig().prefill_graph)
    p.add_argument("--capture", choices=["at_start", "background", "lazy"], default="at_start",
                   help="when graphs are captured (default at_start: steady-state figures; "
                        "bench/startup.py measures serving during a background capture)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above 0, seeded sampling (with --top-k)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature 0.6: Llama-3.1's generation_config.json")
    p.add_argument("--unseeded", action="store_true",
                   help="sampled requests carry no seed, as most clients send them")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="the coordinator keeps no KV blocks for shared prefixes")
    p.add_argument("--decode-cascade", action=argparse.BooleanOptionalAction, default=True,
                   help="decode attends over a prefix the batch shares once (GraphConfig; "
                        "default on)")
    load.add_load_args(p)
    a = p.parse_args()
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    model = a.model or DEFAULT_MODEL
    if a.preset:
        model = bench_model(a.preset, a.load_format)
    name = a.preset or os.path.basename(os.path.normpath(model))
    if load.is_load_mode(a):
        return load_main(a, model, name)
    cfg = make_cfg(a, model)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    engine = engine_phase(cfg, a, vocab)  # first: alone on the device

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    connect(None, log_to_driver=False)
    coord = start_coordinator(cfg)
    params, warm = sampling(a)
    stream_gaps(coord, make_prompts(1, a.prompt_len, vocab, "stream-warm")[0], warm)
    ttft_ms, itl_ms = stream_gaps(coord, make_prompts(1, a.prompt_len, vocab, "stream")[0],
                                  params)
    for b in a.batches:
        prompts = make_prompts(b, a.prompt_len, vocab)
        # this shape's keys, before timing
        ray.get(coord.generate.remote(make_prompts(b, a.prompt_len, vocab, f"warm-{b}"), warm))
        # the run of median time of --repeats (a small model's served step is host-bound and
        # moves run to run), and every run's tok/s; repeats take prompts of their own (the
        # prefix cache would hold the first run's), so tokens are compared on the first
        runs = [served_run(coord, prompts, params)] + [
            served_run(coord, make_prompts(b, a.prompt_len, vocab, f"repeat-{b}-{i}"), params)
            for i in range(1, a.repeats)]
        served, eng = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2], engine[b]
        e2e_ms = 1e3 * served["seconds"] / served["steps"]
        in_process = cfg.parallel.world_size == 1
        eng_ms = 1e3 * eng["seconds"] / eng["steps"] if in_process else served["worker_ms"]
        print(json.dumps({
            "batch": b, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
            "e2e_ms_per_step": round(e2e_ms, 3), "engine_ms_per_step": round(eng_ms, 3),
            "ratio": round(e2e_ms / eng_ms, 2),
            "out_tok_s": round(b * a.max_tokens / served["seconds"], 1),
            "out_tok_s_runs": [round(b * a.max_tokens / r["seconds"], 1) for r in runs],
            "msg_bytes_per_step": eng["msg_bytes_per_step"],
            "encode_us_per_step": eng["encode_us_per_step"],
            "decode_us_per_step": eng["decode_us_per_step"],
            "served_worker_ms_per_step": round(served["worker_ms"], 3),
            "device_idle_ms_per_step": round(served["idle_ms"], 3),
            # speculation: steps that waited for a verify step, stalls that did not
            "loop_waits": served["loop_waits"], "loop_declined": served["loop_declined"],
            "turnaround_ms": served["turnaround_ms"],
            "coordinator_host_ms_per_step": round(served["host_ms"], 3),
            "schedule_update_ms_per_step": round(served["sched_ms"], 3),
            "mean_ttft_ms": round(served["ttft_ms"], 3),
            "stream_itl_ms": round(itl_ms, 3), "stream_ttft_ms": round(ttft_ms, 3),
            "steps": served["steps"], "engine_steps": eng["steps"],
            "decode_steps": eng["decode_steps"],
            "engine_source": "in-process Worker" if in_process
            else "coordinator worker_step_ms (rank 0's device time per step)",
            "tokens_match": runs[0]["tokens"] == eng["tokens"] if in_process else None,
            "device": cfg.device, "dtype": cfg.dtype, "tp": a.tp, "mode": a.mode,
            "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
            "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p,
            "model": name,
        }), flush=True)
    ray.get(coord.shutdown.remote())


if __name__ == "__main__":
    main()
