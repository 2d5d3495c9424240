"""The front door's cost with null engines: what the processes between clients and engines
spend per request and per streamed token, and the replica count where one front process
stops keeping up.

A NullEngine has Engine's surface as the front door calls it (`channel`, `submit_streams`,
`cancel`, `generate`, `describe`, `stats`, start-up and supervision) and no model: every
`--step-ms` each running request gets one token, as StreamDeltas queued per subscription
and sent in batches as Engine sends them, so the front's work per token is the real one.
The real Coordinator starts them (its `engine_cls` argument), so its supervision,
`replica_states` and `generate` routing run too; it places a one-CPU group per replica, so
Ray gets a logical CPU per replica. The engines share this machine's cores with the front.

Clients, bench/load.py's (every request at once, `--streams-per-replica` in flight per
replica, about `--seconds` of requests):
- mux: ReplicaStreams and its Router in this process (load.mux_client, as an HTTP server
  uses them); the front is this process, load generator included.
- http: the real HTTP server actor (api/server.start_http), SSE to load.http_client here;
  the front is the server's process.
- generate: a plain Coordinator.generate per request; the front is the coordinator.

    python -m bench.frontdoor [--replicas 8 16 32 64] [--streams-per-replica 64]
        [--step-ms 15] [--output-len 128] [--seconds 15] [--client mux|http|generate]
        [--api-servers K --load-processes P]   # http: K servers on one port, P load processes

Per point: delivered output tok/s against the ideal (replicas x streams x 1000/step_ms); the
front process's CPU over the timed load (psutil, all threads) per 1k tokens, per request and
in cores; deltas per engine message (the front pays per message and per delta) and tokens
per chunk (deltas merge when the front lags); the engines' mean step period (above
--step-ms: they were short of CPU) and CPU. A table to stderr, a JSON line to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray

from bench import load
from raygraph.channel import ChannelAddress, DeltaChannel
from raygraph.config import ReplicaConfig, ServeConfig
from raygraph.process import freeze_heap
from raygraph.protocol import REPLICA_SHIFT, GenerateResult, RequestTiming, StreamDelta
from raygraph.requests import parse_params, split_prompts

TEXT = " tok"  # each token's text, about what a tokenizer gives a token
SATURATED = 0.9  # delivered / ideal below this: the front no longer keeps up
TARGET_TOK_S = 1e6  # 64 replicas of an 8B model on H100s at ~15k output tok/s each


@dataclass(slots=True)
class Running:
    sink: asyncio.Queue[StreamDelta] | None  # a stream's subscriber; None: a plain generate
    done: asyncio.Future | None  # a plain generate's result
    max_tokens: int
    submitted: float
    first: float = 0.0
    produced: int = 0


class NullEngine:
    """Engine as the front door sees it, without a model: output token i of every request
    is id i. A step emits every running request's token at once, and its delta channel
    sends each subscriber what is queued as one frame, as Engine does. So a subscriber of n
    streams gets one message of n deltas per step while it keeps up."""

    STEP_S = 0.015  # set per run by null_engine

    def __init__(self, cfg: ServeConfig, replica: int, pg: Any) -> None:
        self.cfg, self.replica = cfg, replica
        self.vocab_size = cfg.model_cfg().vocab_size
        self._ids = itertools.count(replica << REPLICA_SHIFT)  # ids name their replica
        self.subscribers = DeltaChannel(self._unsubscribed)
        self.running: dict[int, Running] = {}
        self._work = asyncio.Event()
        self._stopped = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.step_time_s = 0.0  # from each busy step to the next, summed
        self.tokens_generated = 0

    async def start(self) -> dict:
        self._task = asyncio.get_running_loop().create_task(self._step_loop())
        return self.describe()

    def describe(self) -> dict:
        return {"model": self.cfg.model, "vocab_size": self.vocab_size, "max_model_len": 1 << 16}

    def stats(self) -> dict:
        return {"healthy": True, "reason": None, "steps": self.steps,
                "step_time_s": self.step_time_s, "tokens_generated": self.tokens_generated,
                "messages": self.subscribers.frames, "running": len(self.running)}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def is_sleeping(self) -> bool:
        return False

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.subscribers.close()
        self._stopped.set()

    async def channel(self) -> ChannelAddress:
        """Engine.channel: what is queued for a subscriber goes one frame per batch."""
        return await self.subscribers.address(ray.util.get_node_ip_address())

    def _unsubscribed(self, sink: asyncio.Queue) -> None:
        for rid in [rid for rid, r in self.running.items() if r.sink is sink]:
            del self.running[rid]

    async def submit_streams(self, name: str, requests: list[tuple[Any, Any]]
                             ) -> list[int | Exception]:
        sink = self.subscribers.sink(name)
        return [self._add(sink, None, params) for _, params in requests]

    def cancel(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            r = self.running.pop(rid, None)
            if r is not None and r.sink is not None:
                r.sink.put_nowait(StreamDelta(rid, [], None, "abort"))

    async def generate(self, prompts: Any, params: Any = None) -> list[GenerateResult]:
        """Engine.generate, with prompt_token_ids left empty."""
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in split_prompts(prompts)]
        for fut in futs:
            self._add(None, fut, params)
        return list(await asyncio.gather(*futs))

    def _add(self, sink: asyncio.Queue | None, done: asyncio.Future | None, params: Any) -> int:
        rid = next(self._ids)
        self.running[rid] = Running(sink, done, parse_params(params).max_tokens,
                                    time.perf_counter())
        self._work.set()
        return rid

    async def _step_loop(self) -> None:
        """A step every STEP_S while requests run. A late step delays the next one, as a
        device waiting on its host would, rather than a burst catching up."""
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            self._work.clear()
            due = last = loop.time()
            while self.running:
                due = max(due + self.STEP_S, loop.time())
                await asyncio.sleep(due - loop.time())
                now = loop.time()
                self.steps += 1
                self.step_time_s += now - last
                last = now
                self._step()

    def _step(self) -> None:
        now = time.perf_counter()
        finished = []
        for rid, r in self.running.items():
            n = r.produced
            r.produced += 1
            r.first = r.first or now
            last = r.produced >= r.max_tokens
            timing = RequestTiming(0.0, r.first - r.submitted, now - r.submitted) if last else None
            if r.sink is not None:
                r.sink.put_nowait(StreamDelta(rid, [n], TEXT, "length" if last else None,
                                              None, timing))
            elif last and not r.done.done():
                r.done.set_result(GenerateResult(rid, [], list(range(r.produced)),
                                                 TEXT * r.produced, "length", timing=timing))
            if last:
                finished.append(rid)
        self.tokens_generated += len(self.running)
        for rid in finished:
            del self.running[rid]


def null_engine(step_ms: float) -> type:
    """NullEngine stepping every `step_ms` (the coordinator builds engines from a class)."""
    return type("NullEngine", (NullEngine,), {"STEP_S": step_ms / 1e3})


async def start_null(replicas: int, step_ms: float, routing: str = "cache",
                     name: str = "frontdoor") -> tuple[Any, ServeConfig]:
    """A real Coordinator over `replicas` NullEngines, serving; (its handle, its config)."""
    from raygraph.coordinator.coordinator import Coordinator  # torch: not in the engines

    cfg = ServeConfig(device="cpu", replica=ReplicaConfig(replicas=replicas, routing=routing),
                      coordinator_name=f"{name}-{replicas}")
    coord = ray.remote(Coordinator).options(name=cfg.coordinator_name, namespace=cfg.namespace,
                                            num_cpus=0).remote(cfg, null_engine(step_ms))
    await coord.start.remote()
    return coord, cfg


def pid_of(actor: Any) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far, all their threads."""
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def http_session() -> Any:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                 connector=aiohttp.TCPConnector(limit=0))


@ray.remote(num_cpus=0)
def http_load(url: str, model: str, reqs: list[load.Request], streams: int
              ) -> tuple[list[load.RequestRecord], float]:
    """One load-generator process's share of the timed HTTP load (--load-processes): the
    client parses SSE at about the server's cost a chunk, so one process cannot load many."""
    async def run() -> tuple[list[load.RequestRecord], float]:
        async with http_session() as session:
            client = load.http_client(session, url, model)
            return await load.run_load(client, reqs, [0.0] * len(reqs), streams)

    return asyncio.run(run())


async def timed_load(a: argparse.Namespace, client: load.Client, reqs: list[load.Request],
                     streams: int, url: str | None, model: str
                     ) -> tuple[list[load.RequestRecord], float]:
    """The timed load: in this process, or over --load-processes (HTTP only)."""
    if url is None or a.load_processes == 1:
        return await load.run_load(client, reqs, [0.0] * len(reqs), streams)
    n = a.load_processes
    parts = await asyncio.gather(*(http_load.remote(url, model, reqs[i::n], -(-streams // n))
                                   for i in range(n)))
    return [r for records, _ in parts for r in records], max(secs for _, secs in parts)


def generate_client(coord: Any) -> load.Client:
    """A plain Coordinator.generate per request: one chunk, the whole output."""
    async def stream(prompt: list[int], params: Any) -> AsyncIterator[load.Chunk]:
        (r,) = await coord.generate.remote(prompt, params)
        yield load.Chunk(time.perf_counter(), len(r.token_ids), None, r.timing)
    return stream


async def run_point(a: argparse.Namespace, replicas: int, expect_tok_s: float) -> dict:
    """One replica count on a fresh coordinator: a warm-up, then the timed load, enough
    requests for --seconds at `expect_tok_s` (the last point's rate) and one per stream."""
    a.concurrency = streams = replicas * a.streams_per_replica
    ideal = streams * 1e3 / a.step_ms
    a.num_prompts = max(streams, round(a.seconds * min(ideal, expect_tok_s) / a.output_len))
    vocab = ServeConfig().model_cfg().vocab_size
    reqs = load.make_requests(a, vocab)
    warmup = load.warmup_requests(reqs, vocab, a.seed)
    coord, cfg = await start_null(replicas, a.step_ms, a.routing)
    pids = {"bench": [os.getpid()], "coordinator": [pid_of(coord)],
            "engines": [pid_of(s.engine) for s in await coord.replica_states.remote()]}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(ray.kill, coord)
        stack.push_async_callback(coord.shutdown.remote)
        url = None
        if a.client == "http":
            from raygraph.api.server import HttpConfig, start_http, stop_http

            handles, url = start_http(HttpConfig(port=0, replicas=a.api_servers),
                                      cfg.coordinator_name, cfg.namespace)
            stack.callback(stop_http, cfg.coordinator_name, cfg.namespace)
            pids["http"] = [pid_of(h) for h in handles]
            session = await stack.enter_async_context(http_session())
            client = load.http_client(session, url, Path(cfg.model).name)
        else:
            client = load.mux_client(coord) if a.client == "mux" else generate_client(coord)
        warm, _ = await load.run_load(client, warmup, [0.0] * len(warmup))
        if not all(r.ok for r in warm):
            raise RuntimeError(f"warm-up failed: {[r.error for r in warm]}")
        stats = await coord.stats.remote()
        cpu = {k: -cpu_s(v) for k, v in pids.items()}
        freeze_heap()  # as load.benchmark: no full collection of the client's heap mid-run
        try:
            records, secs = await timed_load(a, client, reqs, streams, url,
                                             Path(cfg.model).name)
        finally:
            gc.unfreeze()
        cpu = {k: c + cpu_s(pids[k]) for k, c in cpu.items()}
        after = await coord.stats.remote()
    s = load.summarize(records, secs)
    front = cpu[{"mux": "bench", "http": "http", "generate": "coordinator"}[a.client]]
    tokens, done = s["total_output_tokens"], s["completed"]
    chunks = sum(len(r.token_chunks) for r in records if r.ok)
    steps, msgs = (after[k] - stats[k] for k in ("steps", "messages"))
    return {"replicas": replicas, "streams": streams, "requests": done, "failed": s["failed"],
            "api_servers": a.api_servers if a.client == "http" else None,
            "duration_s": s["duration_s"], "output_tokens": tokens,
            "output_tok_s": s["output_throughput"],
            "ideal_tok_s": round(ideal), "ratio": round(s["output_throughput"] / ideal, 3),
            "front_cpu_s": round(front, 2), "front_cores": round(front / secs, 2),
            "front_cpu_s_per_1k_tok": round(1e3 * front / max(1, tokens), 4),
            "front_cpu_ms_per_request": round(1e3 * front / max(1, done), 3),
            "tokens_per_chunk": round(tokens / max(1, chunks), 2),
            "messages_per_s": round(msgs / secs),  # engine -> front (none: generate)
            "deltas_per_message": round(tokens / msgs, 1) if msgs else None,
            "engines_cpu_s_per_1k_tok": round(1e3 * cpu["engines"] / max(1, tokens), 4),
            "engine_step_ms": round(1e3 * (after["step_time_s"] - stats["step_time_s"])
                                    / max(1, steps), 2),
            "median_ttft_ms": s["median_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"],
            **{f"{k}_cpu_s": round(v, 2) for k, v in cpu.items()},
            "load_avg_1m": os.getloadavg()[0],  # the machine's, this run included
            **({"first_error": s["first_error"]} if "first_error" in s else {})}


COLUMNS = [("replicas", "replicas"), ("streams", "streams"), ("requests", "requests"),
           ("output_tok_s", "delivered tok/s"), ("ideal_tok_s", "ideal tok/s"),
           ("ratio", "delivered/ideal"), ("front_cpu_s_per_1k_tok", "front CPU s / 1k tok"),
           ("front_cpu_ms_per_request", "front CPU ms / request"), ("front_cores", "front cores"),
           ("deltas_per_message", "deltas/msg"), ("tokens_per_chunk", "tok/chunk"),
           ("engine_step_ms", "engine step ms"),
           ("engines_cpu_s_per_1k_tok", "engines CPU s / 1k tok"),
           ("median_ttft_ms", "TTFT p50 ms")]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c for _, c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{r[k]:,}" if isinstance(r[k], int) else str(r[k])
                                for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Where it saturates, and what the 1M tok/s target needs at the cost per token of the
    points that kept up (of all points if none did)."""
    sat = next((r["replicas"] for r in rows if r["ratio"] < SATURATED), None)
    kept = [r for r in rows if r["ratio"] >= SATURATED] or rows
    us = 1e3 * max(r["front_cpu_s_per_1k_tok"] for r in kept)
    best = max(r["output_tok_s"] for r in rows)
    return {"saturates_at_replicas": sat, "front_us_per_token": round(us, 2),
            "cores_for_target": round(us * TARGET_TOK_S / 1e6, 1),
            "max_front_tok_s": best, "fronts_for_target": math.ceil(TARGET_TOK_S / best)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--streams-per-replica", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=15.0,
                   help="the null engines' step (an 8B decode step at batch ~256 on an H100)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seconds", type=float, default=15.0,
                   help="each point's length, roughly (at least one request per stream)")
    p.add_argument("--client", choices=["mux", "http", "generate"], default="mux")
    p.add_argument("--api-servers", type=int, default=1,
                   help="http: HTTP server actors sharing the port (--api-server-count)")
    p.add_argument("--load-processes", type=int, default=1,
                   help="http: processes generating the timed load, each a share of it")
    p.add_argument("--routing", choices=["cache", "load", "round-robin"], default="cache")
    p.set_defaults(seed=0, range_ratio=0.0, temperature=0.0, top_k=0, top_p=1.0, unseeded=False,
                   shared_prefix_len=0,
                   num_prefixes=1)  # load.make_requests' other fields
    return p


def main() -> None:
    a = parser().parse_args()
    from raygraph.client.connect import connect

    connect(None, num_cpus=max(a.replicas) + a.api_servers + 2, log_to_driver=False)
    rows: list[dict] = []
    for n in a.replicas:
        rows.append(asyncio.run(run_point(a, n, rows[-1]["output_tok_s"] if rows
                                          else math.inf)))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows), file=sys.stderr, flush=True)
    flags = {k: v for k, v in vars(a).items() if k not in ("concurrency", "num_prompts")}
    print(json.dumps({"rows": rows, **summary(rows), **flags}), flush=True)


if __name__ == "__main__":
    main()
