"""A load benchmark like `vllm bench serve`: requests arrive as a seeded Poisson process, each
one a streaming client, and the report is what users see (TTFT, ITL, TPOT, end-to-end
latency) with the throughputs.

The workload is vLLM's "random" dataset: each prompt length and each output length is drawn
uniformly from the integers in [int(L*(1-r)), int(L*(1+r))] (at least 1), prompts are random
token ids in [3, vocab), requests use ignore_eos with max_tokens = the drawn output length.
With --shared-prefix-len N every prompt starts with a random N-token prefix (a system prompt;
--num-prefixes P of them, each request taking one at random) and goes on with its own drawn
suffix; the report then gives the prefix cache's hit
rate over the timed requests (tokens found cached / tokens looked up), from the
coordinator's stats or the server's /metrics.

A client is any function (prompt ids, params) -> async iterator of Chunk, one per streamed
message: `ray_client` (Coordinator.generate_stream) and `http_client` (OpenAI completions SSE)
are the two here. This module imports neither Ray nor torch: its logic is tested on its own.

Per request, from the moment it is launched:
- TTFT: until the first chunk that carries tokens.
- ITL, per token: a chunk carrying k tokens adds one gap (since the previous token chunk) and
  k-1 zero gaps; the first chunk's extra tokens add k-1 zeros. A request so gives one gap per
  output token after the first, and its mean gap is its TPOT. (vLLM appends one gap per chunk,
  SGLang spreads a chunk's gap over its tokens: all agree when each chunk carries one token.)
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with more than one output token.
- E2EL: until the last chunk that carries tokens.
Output tokens are the server's count when it gives one (HTTP usage), else the chunks' sum.
Through Ray the last delta also carries the coordinator's own timing (RequestTiming), reported
as server_queue (submitted -> first scheduled) and server_ttft (submitted -> first token): the
client's TTFT less server_ttft is its call's way in and the first token's way out.
ITL pools the gaps of all requests; the other figures are one value per request. A request
fails when its client raises or no token arrives; figures cover completed requests only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from raygraph.process import freeze_heap
from raygraph.protocol import RequestTiming, SamplingParams


class Chunk(NamedTuple):
    time: float  # time.perf_counter() when the chunk arrived
    tokens: int  # new output tokens it carries
    total: int | None = None  # the server's count of output tokens so far, when it says
    timing: RequestTiming | None = None  # the coordinator's own figures, on a last delta


Client = Callable[[list[int], SamplingParams], AsyncIterator[Chunk]]


class Request(NamedTuple):
    prompt: list[int]
    params: SamplingParams


def sample_lengths(n: int, length: int, ratio: float, rng: random.Random) -> list[int]:
    """n integers uniform in [int(L*(1-r)), int(L*(1+r))], at least 1 (vLLM's random set)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {ratio}")
    lo = max(1, int(length * (1 - ratio)))
    hi = max(lo, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Launch offsets in seconds: the first at 0, then exponential gaps of mean 1/rate (a
    Poisson process); rate inf launches everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_requests(a: argparse.Namespace, vocab: int) -> list[Request]:
    """The timed workload, from --seed alone: the same flags give the same requests."""
    rng = random.Random(a.seed)
    ins = sample_lengths(a.num_prompts, a.input_len, a.range_ratio, rng)
    outs = sample_lengths(a.num_prompts, a.output_len, a.range_ratio, rng)
    seeded = a.temperature > 0 and not a.unseeded
    # drawn after the lengths, so the suffixes' lengths do not depend on the prefixes'
    prefixes = [[rng.randrange(3, vocab) for _ in range(a.shared_prefix_len)]
                for _ in range(a.num_prefixes)]
    picks = [rng.randrange(a.num_prefixes) for _ in ins] if a.num_prefixes > 1 else [0] * len(ins)
    return [Request(prefixes[picks[k]] + [rng.randrange(3, vocab) for _ in range(i)],
                    SamplingParams(max_tokens=o, ignore_eos=True, temperature=a.temperature,
                                   top_k=a.top_k, top_p=a.top_p,
                                   seed=a.seed + k if seeded else None))
            for k, (i, o) in enumerate(zip(ins, outs))]


def warmup_requests(reqs: list[Request], vocab: int, seed: int, n: int = 4) -> list[Request]:
    """A few short requests of the longest prompt length, with prompts of their own (a timed
    prompt seen in warm-up would hit the prefix cache)."""
    rng, plen = random.Random(f"warmup-{seed}"), max(len(r.prompt) for r in reqs)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return [Request([rng.randrange(3, vocab) for _ in range(plen)], params)
            for _ in range(min(n, len(reqs)))]


def itl_gaps(chunks: Sequence[Chunk]) -> list[float]:
    """Seconds between consecutive tokens of one request, by the rule in the module doc."""
    gaps: list[float] = []
    last: float | None = None
    for c in chunks:
        if c.tokens <= 0:
            continue
        if last is not None:
            gaps.append(c.time - last)
        gaps.extend([0.0] * (c.tokens - 1))
        last = c.time
    return gaps


@dataclass
class RequestRecord:
    """What one client saw: its launch time, every chunk, and the error if it failed."""

    prompt_len: int
    start: float
    chunks: list[Chunk] = field(default_factory=list)
    error: str | None = None

    @property
    def token_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.tokens > 0]

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_chunks)

    @property
    def output_tokens(self) -> int:
        totals = [c.total for c in self.chunks if c.total is not None]
        return totals[-1] if totals else sum(c.tokens for c in self.chunks)

    @property
    def ttft(self) -> float:
        return self.token_chunks[0].time - self.start

    @property
    def timing(self) -> RequestTiming | None:
        return next((c.timing for c in self.chunks if c.timing is not None), None)

    @property
    def e2e(self) -> float:
        return self.token_chunks[-1].time - self.start

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    s = sorted(values)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """vLLM's result fields (median_* is p50), latencies in ms."""
    ok = [r for r in records if r.ok]
    inp, out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    row: dict[str, Any] = {
        "duration_s": round(duration, 3), "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out / duration, 2),
        "total_token_throughput": round((inp + out) / duration, 2),
        # requests in flight on average (Little's law): what a rate "keeps running"
        "mean_concurrency": round(sum(r.e2e for r in ok) / duration, 1) if duration else None,
    }
    tpots = [t for r in ok if (t := r.tpot) is not None]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots,
              "itl": [g for r in ok for g in itl_gaps(r.chunks)], "e2el": [r.e2e for r in ok]}
    timed = [t for r in ok if (t := r.timing) is not None]
    if timed:  # the client's TTFT less these: its call in and the first token's way out
        series |= {"server_queue": [t.queue_s for t in timed],
                   "server_ttft": [t.ttft_s for t in timed]}
    for name, secs in series.items():
        ms = [1e3 * s for s in secs]
        row[f"mean_{name}_ms"] = round(sum(ms) / len(ms), 3) if ms else None
        for label, q in (("median", 50), ("p90", 90), ("p99", 99)):
            v = percentile(ms, q)
            row[f"{label}_{name}_ms"] = None if v is None else round(v, 3)
    errors = [r.error for r in records if r.error]
    if errors:
        row["first_error"] = errors[0]
    return row


async def run_request(client: Client, req: Request) -> RequestRecord:
    rec = RequestRecord(len(req.prompt), time.perf_counter())
    try:
        async for chunk in client(req.prompt, req.params):
            rec.chunks.append(chunk)
    except Exception as e:  # a failed request is a figure of the run, not its end
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_load(client: Client, reqs: Sequence[Request], arrivals: Sequence[float],
                   max_concurrency: int | None = None) -> tuple[list[RequestRecord], float]:
    """Launch each request at its arrival offset, at most `max_concurrency` in flight (as
    vllm bench serve: a request past the cap waits, and its clock starts when it is sent);
    (records, duration: first launch to last completion)."""
    t0 = time.perf_counter()
    cap = asyncio.Semaphore(max_concurrency or len(reqs) or 1)

    async def launch(req: Request, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with cap:
            return await run_request(client, req)

    records = await asyncio.gather(*(launch(r, at) for r, at in zip(reqs, arrivals)))
    return list(records), time.perf_counter() - t0


Counters = Callable[[], Awaitable[tuple[float, float] | None]]


async def benchmark(client: Client, reqs: list[Request], warmup: list[Request],
                    arrivals: list[float], max_concurrency: int | None = None,
                    prefix_counters: Counters | None = None) -> dict[str, Any]:
    """Warm up (untimed, all at once: new shapes are captured there), then the timed load.
    `prefix_counters()`: the server's prefix cache (queries, hits) in tokens, read around the
    timed load for its hit rate (None where the server does not say)."""
    warm, _ = await run_load(client, warmup, [0.0] * len(warmup))
    failed = [r.error or "no token arrived" for r in warm if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")
    before = await prefix_counters() if prefix_counters else None
    freeze_heap()  # the client's own collections must not stall its streams mid-run
    try:
        records, duration = await run_load(client, reqs, arrivals, max_concurrency)
    finally:
        gc.unfreeze()
    row = summarize(records, duration)
    after = await prefix_counters() if prefix_counters else None
    row |= prefix_hit_rate(before, after)
    return row


def prefix_hit_rate(before: tuple[float, float] | None,
                    after: tuple[float, float] | None) -> dict[str, Any]:
    """The timed requests' prefix cache figures from (queries, hits) counters around them."""
    if before is None or after is None:
        return {"prefix_cache_queries": None, "prefix_cache_hits": None,
                "prefix_cache_hit_rate": None}
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"prefix_cache_queries": int(queries), "prefix_cache_hits": int(hits),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0}


def coordinator_counters(coord: Any) -> Counters:
    """(queries, hits) from coordinator.stats()."""
    async def read() -> tuple[float, float]:
        kv = (await coord.stats.remote())["kv_cache"]
        return kv["prefix_cache_queries"], kv["prefix_cache_hits"]
    return read


def metrics_counters(session: Any, endpoint: str) -> Counters:
    """(queries, hits) from the server's Prometheus /metrics (None when it has neither)."""
    names = ("raygraph:prefix_cache_queries_total", "raygraph:prefix_cache_hits_total")

    async def read() -> tuple[float, float] | None:
        async with session.get(endpoint.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        values = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return (values[names[0]], values[names[1]]) if len(values) == 2 else None
    return read


def ray_client(coord: Any) -> Client:
    """Coordinator.generate_stream through Ray: one chunk per StreamDelta, of len(token_ids)."""
    async def stream(prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        gen = coord.generate_stream.options(num_returns="streaming").remote(prompt, params)
        async for ref in gen:
            delta = await ref
            yield Chunk(time.perf_counter(), len(delta.token_ids), None, delta.timing)
    return stream


def mux_client(coord: Any) -> Client:
    """Streams multiplexed over one subscription per engine (raygraph.client.streams, what an
    HTTP server uses): one chunk per merged delta, of len(token_ids)."""
    import ray

    from raygraph.client.streams import ReplicaStreams

    hub = ReplicaStreams.from_info(coord, ray.get(coord.describe.remote()))

    async def stream(prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        rid = await hub.open(prompt, params)
        while True:
            delta = await hub.next(rid)
            yield Chunk(time.perf_counter(), len(delta.token_ids), None, delta.timing)
            if delta.finish_reason is not None:
                return
    return stream


def http_client(session: Any, endpoint: str, model: str) -> Client:
    """OpenAI `POST /v1/completions` with stream and include_usage, over an aiohttp session:
    one token per SSE chunk with non-empty choices (text chunks do not say how many tokens
    they carry), the output total from the final usage chunk."""
    url = endpoint.rstrip("/") + "/v1/completions"

    async def stream(prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        body: dict[str, Any] = {
            "model": model, "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "ignore_eos": params.ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.top_p < 1:
            body["top_p"] = params.top_p
        if params.seed is not None:
            body["seed"] = params.seed
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:  # aiohttp yields the body line by line
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    return
                msg = json.loads(data)
                if msg.get("choices"):
                    yield Chunk(time.perf_counter(), 1)
                elif usage := msg.get("usage"):
                    yield Chunk(time.perf_counter(), 0, int(usage["completion_tokens"]))
    return stream


async def benchmark_http(endpoint: str, model: str, reqs: list[Request],
                         warmup: list[Request], arrivals: list[float],
                         max_concurrency: int | None = None) -> dict[str, Any]:
    import aiohttp  # ray[default] brings it; only the --endpoint client needs it

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent requests
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        return await benchmark(http_client(session, endpoint, model), reqs, warmup, arrivals,
                               max_concurrency, metrics_counters(session, endpoint))


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load mode (any of --request-rate, --num-prompts, --endpoint)")
    g.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second; inf: all at once (the default)")
    g.add_argument("--num-prompts", type=int, default=None, help="default 200")
    g.add_argument("--client", choices=["ray", "mux"], default="ray",
                   help="without --endpoint: ray, a Ray stream per request "
                        "(generate_stream); mux, every stream over one subscription")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no cap)")
    g.add_argument("--input-len", type=int, default=512,
                   help="prompt tokens (after the shared prefix, with --shared-prefix-len)")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="distinct shared prefixes (system prompts), each request taking one "
                        "at random")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with the same random N tokens (default: 0)")
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--endpoint", default=None,
                   help="http://HOST:PORT of an OpenAI-compatible server instead of Ray")
    g.add_argument("--json-out", default=None, help="also write the JSON result here")


def is_load_mode(a: argparse.Namespace) -> bool:
    return a.request_rate is not None or a.num_prompts is not None or a.endpoint is not None


def fill_load_defaults(a: argparse.Namespace) -> None:
    a.request_rate = math.inf if a.request_rate is None else a.request_rate
    a.num_prompts = 200 if a.num_prompts is None else a.num_prompts
    a.max_num_batched_tokens = a.max_num_batched_tokens or 2048


TABLE = [
    ("Successful requests", "completed"), ("Failed requests", "failed"),
    ("Request rate (req/s)", "request_rate"), ("Benchmark duration (s)", "duration_s"),
    ("Total input tokens", "total_input_tokens"),
    ("Total generated tokens", "total_output_tokens"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Output token throughput (tok/s)", "output_throughput"),
    ("Total token throughput (tok/s)", "total_token_throughput"),
    ("Mean requests in flight", "mean_concurrency"),
    ("Prefix cache hit rate", "prefix_cache_hit_rate"),
]
SECTIONS = [("ttft", "TTFT", "Time to First Token"),
            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"),
            ("server_queue", "queue", "Coordinator: submitted to scheduled"),
            ("server_ttft", "TTFT", "Coordinator: submitted to first token")]


def format_table(row: dict[str, Any]) -> str:
    """The result as vllm bench serve prints it."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{label + ':':<40}{row[key]}" for label, key in TABLE
              if row.get(key) is not None]
    for key, short, title in SECTIONS:
        if f"mean_{key}_ms" not in row:
            continue  # the coordinator's figures: not over HTTP
        lines.append(f"{' ' + title + ' ':-^50}")
        for stat in ("mean", "median", "p90", "p99"):
            v = row[f"{stat}_{key}_ms"]
            lines.append(f"{stat.capitalize() + ' ' + short + ' (ms):':<40}"
                         + ("n/a" if v is None else f"{v:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)
