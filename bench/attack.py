"""The hardening attack, re-run as one command: `raygraph serve` with an API key, then

1. `--clients` concurrent clients for `--seconds`, a tenth of their requests malformed or
   overflowing (seeds past int64, top_k past uint64, bad JSON, wrong types, NaN, seed + n
   overflowing, ...): every good request must complete, every bad one get a 4xx, the worker
   group never restart, and /health (probed every 100 ms meanwhile) answer quickly;
2. an unauthenticated 100 MB body: refused in how long, and the API server's memory after;
3. kill -9 of the only API server: seconds until the port serves again.

    python -m bench.attack [--seconds 60] [--clients 200] [--model DIR] [--device cpu]

Prints one JSON line of figures (bench/RESULTS.md keeps them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

KEY = "attack-key"
RAYGRAPH = str(Path(sys.executable).parent / "raygraph")

GOOD = {"prompt": "The import statement", "max_tokens": 8}
BAD: list[dict | bytes] = [
    {**GOOD, "seed": 1180591620717411303424},
    {**GOOD, "seed": -(2**63) - 1},
    {**GOOD, "top_k": 2**64},
    {**GOOD, "seed": 18446744073709551615, "n": 2},
    {**GOOD, "max_tokens": -1},
    {**GOOD, "max_tokens": 10**30},
    {**GOOD, "temperature": "NaN"},
    {**GOOD, "temperature": 1e999},
    {**GOOD, "stop_token_ids": [2**70]},
    {**GOOD, "prompt": [2**40]},
    {**GOOD, "prompt": []},
    {**GOOD, "n": 0},
    {**GOOD, "logprobs": 10**9},
    {"prompt": {"nested": True}, "max_tokens": 4},
    b'{"prompt": "x", "max_tokens": ',
    b"\xff\xfe not json",
]


def serve(port: int, model: str | None, device: str) -> subprocess.Popen:
    args = [RAYGRAPH, "serve", "--port", str(port), "--api-key", KEY, "--device", device]
    if model:
        args += ["--model", model]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "HTTP server at " in line:
            return proc
    raise RuntimeError("raygraph serve did not start")


def http_process(serve_proc: subprocess.Popen) -> psutil.Process:
    for _ in range(100):
        for p in psutil.Process(serve_proc.pid).children(recursive=True):
            try:
                if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::HttpServer"):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise RuntimeError("no API server process")


async def load(url: str, seconds: float, clients: int) -> dict:
    counts = {"good_ok": 0, "good_failed": 0, "bad_4xx": 0, "bad_other": 0}
    failures: list[str] = []
    health: list[float] = []
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    end = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        while time.monotonic() < end:
            bad = rng.random() < 0.1
            body = rng.choice(BAD) if bad else {**GOOD, "stream": rng.random() < 0.5}
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                async with session.post(url + "/v1/completions", data=data,
                                        headers=auth) as r:
                    text = await r.text()
                    status = r.status
            except aiohttp.ClientError as e:
                status, text = 0, repr(e)
            if bad:
                counts["bad_4xx" if 400 <= status < 500 else "bad_other"] += 1
                if not 400 <= status < 500:
                    failures.append(f"bad {body!r:.80}: {status} {text:.120}")
            elif status == 200 and '"error"' not in text:
                counts["good_ok"] += 1
            else:
                counts["good_failed"] += 1
                failures.append(f"good: {status} {text:.160}")

    async def prober(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            async with session.get(url + "/health") as r:
                await r.read()
            health.append(time.perf_counter() - t0)
            await asyncio.sleep(0.1)

    conn = aiohttp.TCPConnector(limit=clients + 8)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(prober(session),
                             *(client(session, random.Random(i)) for i in range(clients)))
        async with session.get(url + "/metrics") as r:
            metrics = await r.text()
    restarts = [ln for ln in metrics.splitlines()
                if ln.startswith("raygraph:worker_restarts_total")]
    health.sort()
    return {**counts, "failures": failures[:5], "health_probes": len(health),
            "health_p50_s": round(health[len(health) // 2], 4),
            "health_p99_s": round(health[int(len(health) * 0.99)], 4),
            "worker_restarts_total": restarts}


def big_body(host: str, port: int, size: int) -> tuple[float, str]:
    """An unauthenticated body of `size` bytes sent as fast as the socket takes it: seconds
    to the answer and its status line."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port)) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        s.settimeout(60)
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(size >> 20):
                s.sendall(chunk)
        except OSError:
            pass  # the server answered and closed: what we want
        status = s.recv(4096).split(b"\r\n", 1)[0].decode()
    return time.perf_counter() - t0, status


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = serve(port, a.model, a.device)
    try:
        out = asyncio.run(load(url, a.seconds, a.clients))
        http = http_process(proc)
        rss0 = http.memory_info().rss
        seconds, status = big_body("127.0.0.1", port, 100 << 20)
        out |= {"big_body_s": round(seconds, 3), "big_body_status": status,
                "api_server_rss_mib": [rss0 >> 20, http.memory_info().rss >> 20]}
        http.kill()
        t0 = time.monotonic()
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    if s.recv(64).startswith(b"HTTP/1.1"):
                        break
            except OSError:
                time.sleep(0.1)
        out["port_serves_again_s"] = round(time.monotonic() - t0, 2)
    finally:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: a clean stop
        proc.wait(60)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
