"""Speculative decoding through the served loop's logic in one process (EngineCore over an
in-process Worker), against the same requests without speculation (greedy tokens compared).

N-gram mode: acceptance (drafts kept / drafts proposed), steps and time on a code-editing
style load.

    python -m bench.speculative [--model DIR] [--requests 8] [--max-tokens 96] [--k 4]
        [--load code|pydoc]

`code`: each request gives a standard-library function's source, then asks for it again
after a comment (an edit repeats most of its input). `pydoc`: a paragraph of the built-in
model's training text, then its first sentence again (a model that knows the text
continues it as in the prompt).

Oracle mode: what verifying costs and gains when every draft holds. A plain run records
each request's greedy tokens; the speculative run's proposer drafts the next k of them
(OracleProposer), so acceptance is ~100% and the speedup is the most k drafts can give.

    python -m bench.speculative --oracle [--preset llama3-8b --load-format dummy]
        [--batches 1 64 256] [--k 4] [--prompt-tokens 128] [--max-tokens 256]
        [--disable-by-batch-size N]

Per batch (that many concurrent requests, random prompt tokens seeded by the batch size):
output tok/s plain, speculating, and, at batches >= N, speculating with
disable_by_batch_size = N ("adaptive": no drafts from N running sequences). tok_s is over
the whole run, decode_tok_s from the step at which every request has its first token. Then
per batch the direct step timing: Worker.execute of a hand-built step (decode_step's plans:
every sequence at prompt + max_tokens / 2 cached tokens) computing 1 token against 1 + k
(a verify step), median seconds from the plan to the tokens on the host. Prints one JSON
line per run and per timing, then a table; exits 1 if any request's tokens differ from plain.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch

from bench.checkpoints import bench_model
from bench.decode_step import time_worker
from bench.serving import make_prompts
from raygraph.config import (
    DEFAULT_MODEL,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from raygraph.engine.core import EngineCore, local_dispatch
from raygraph.engine.ngram import NgramIndex
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams
from raygraph.tokenizer import load_tokenizer
from raygraph.worker.worker import Worker

BLOCK = 16  # KV block size (tokens)
# (request index, prompt) -> the request's proposer: NgramIndex's interface (extend, propose)
Proposer = Callable[[int, list[int]], Any]


class OracleProposer:
    """Drafts the target's own greedy continuation, recorded by a plain run: the next k
    recorded tokens after the sequence's current length. Every draft holds as long as the
    speculative run's tokens equal the plain run's."""

    def __init__(self, prompt_len: int, recorded: list[int]) -> None:
        self.prompt_len = prompt_len
        self.recorded = recorded
        self.num_tokens = 0  # prompt and outputs so far, as extend() gave them

    def extend(self, tokens: Iterable[int]) -> None:
        self.num_tokens += sum(1 for _ in tokens)

    def propose(self, k: int) -> list[int]:
        at = self.num_tokens - self.prompt_len  # outputs so far
        return self.recorded[at: at + k] if k > 0 and at >= 0 else []


def oracles(recorded: list[list[int]]) -> Proposer:
    """Request i's proposer: an OracleProposer over recorded[i]."""
    return lambda i, prompt: OracleProposer(len(prompt), recorded[i])


def prompts(load: str) -> list[str]:
    """`code`: function sources of the standard library, each followed by a request to write
    it again (the first line given). `pydoc`: paragraphs of the pydoc topics (the built-in
    model's training text), each followed by its first sentence again."""
    import json as json_module
    import shlex
    import textwrap

    if load == "pydoc":
        from pydoc_data.topics import topics

        paragraphs = [p for text in topics.values() for p in text.split("\n\n")
                      if 300 < len(p) < 900]
        return [f"{p}\n\nAgain:\n\n{p.split('. ')[0]}" for p in paragraphs]
    out = []
    for module in (textwrap, json_module, shlex):
        for _, f in inspect.getmembers(module, inspect.isfunction):
            src = inspect.getsource(f)
            out.append(f"{src}\n# The same function, with the docstring shortened:\n"
                       f"{src.splitlines()[0]}\n")
    return out


def make_worker(cfg: ServeConfig, blocks: int) -> Worker:
    """One worker for every run: loaded, `blocks` KV blocks bound, the start-up schedule
    captured."""
    worker = Worker(cfg, 0)
    worker.load(("127.0.0.1", 0))
    worker.allocate_kv_cache(blocks)
    worker.capture_all()
    return worker


def run(cfg: ServeConfig, worker: Worker, ids: list[list[int]], max_tokens: int,
        blocks: int, proposer: Proposer | None = None) -> dict:
    """Greedy requests (ignore_eos) through EngineCore.step until all finish; with
    `proposer`, each speculates with the object it returns. `steps` counts steps sent to the
    worker (a flush of the step in flight is none)."""
    core = EngineCore.from_config(cfg, worker.model_cfg, blocks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True).resolved()
    seqs = [Sequence(i, p, params) for i, p in enumerate(ids)]
    if proposer is not None:
        for seq in seqs:
            seq.ngram = proposer(seq.seq_id, seq.prompt_token_ids)
            seq.ngram.extend(seq.prompt_token_ids)
    core.add(seqs)
    dispatch = local_dispatch(worker)
    t0 = time.perf_counter()
    decoding = 0.0  # when every request had its first token
    while core.step(dispatch) is not None:
        if not decoding and all(s.output_token_ids for s in seqs):
            decoding = time.perf_counter()
    end = time.perf_counter()
    sched = core.schedulers[0]
    return {"seconds": end - t0, "decode_seconds": end - (decoding or t0),
            "steps": core.step_id, "tokens": [s.output_token_ids for s in seqs],
            "drafts": sched.num_draft_tokens, "kept": sched.num_accepted_tokens}


def speculating(cfg: ServeConfig, k: int, disable_by_batch_size: int = 0) -> ServeConfig:
    return msgspec.structs.replace(cfg, speculative=SpeculativeConfig(
        method="ngram", num_speculative_tokens=k, disable_by_batch_size=disable_by_batch_size))


def ngram_main(a: argparse.Namespace, device: str) -> None:
    tok = load_tokenizer(a.model)
    room = ModelConfig.from_pretrained(a.model).max_position_embeddings - a.max_tokens - 16
    ids = [i for i in map(tok.encode, prompts(a.load)) if len(i) <= room][: a.requests]
    longest = max(len(i) for i in ids) + a.max_tokens + 16
    blocks = len(ids) * -(-longest // BLOCK) + 8
    cfg = ServeConfig(model=a.model, device=device,
                      cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=max(8, len(ids) * (a.k + 1)),
                                                max_num_batched_tokens=2048,
                                                max_model_len=longest))
    worker = make_worker(cfg, blocks)
    spec_cfg = speculating(cfg, a.k)
    s = spec_cfg.speculative
    plain = run(cfg, worker, ids, a.max_tokens, blocks)
    spec = run(spec_cfg, worker, ids, a.max_tokens, blocks,
               lambda i, p: NgramIndex(s.prompt_lookup_min, s.prompt_lookup_max))
    print(json.dumps({
        "model": a.model, "device": device, "load": a.load, "requests": len(ids), "k": a.k,
        "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
        "acceptance": round(spec["kept"] / max(1, spec["drafts"]), 3),
        "drafts": spec["drafts"], "kept": spec["kept"],
        "steps_plain": plain["steps"], "steps_spec": spec["steps"],
        "seconds_plain": round(plain["seconds"], 2), "seconds_spec": round(spec["seconds"], 2),
        "tokens_equal": plain["tokens"] == spec["tokens"],
    }), flush=True)


def timed(cfg: ServeConfig, worker: Worker, ids: list[list[int]], a: argparse.Namespace,
          blocks: int, proposer: Proposer | None = None) -> dict:
    """A short untimed run first (shapes first seen compile or autotune), then the run."""
    run(cfg, worker, ids, min(16, a.max_tokens), blocks, proposer)
    return run(cfg, worker, ids, a.max_tokens, blocks, proposer)


def summary(batch: int, mode: str, r: dict, plain: dict) -> dict:
    """One run's JSON row; ratios against the plain run of the same batch."""
    out = sum(map(len, r["tokens"]))
    tok_s, decode_tok_s = out / r["seconds"], (out - batch) / r["decode_seconds"]
    plain_out = sum(map(len, plain["tokens"]))
    return {"batch": batch, "mode": mode, "output_tokens": out, "steps": r["steps"],
            "seconds": round(r["seconds"], 3), "tok_s": round(tok_s, 1),
            "decode_tok_s": round(decode_tok_s, 1),
            "speedup": round(tok_s / (plain_out / plain["seconds"]), 3),
            "decode_speedup": round(decode_tok_s / ((plain_out - batch)
                                                    / plain["decode_seconds"]), 3),
            "drafts": r["drafts"], "kept": r["kept"],
            "acceptance": round(r["kept"] / r["drafts"], 4) if r["drafts"] else None,
            "mismatched_seqs": sum(x != y for x, y in zip(r["tokens"], plain["tokens"]))}


def oracle_main(a: argparse.Namespace, device: str) -> int:
    """Every batch's plain, speculating and adaptive runs on one worker, then the direct
    step timings; returns the requests whose tokens differed from plain."""
    model = bench_model(a.preset, a.load_format) if a.preset else a.model
    top = max(a.batches)
    longest = a.prompt_tokens + a.max_tokens + a.k + BLOCK
    blocks = top * -(-longest // BLOCK) + 8
    # a logits row per sequence and draft: max_num_seqs and the token budget let every
    # request verify k drafts in the same step
    rows = top * (a.k + 1)
    cfg = ServeConfig(model=model, device=device, load_format=a.load_format,
                      cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=rows,
                                                max_num_batched_tokens=max(2048, rows),
                                                max_model_len=longest))
    t0 = time.perf_counter()
    worker = make_worker(cfg, blocks)
    print(json.dumps({"model": model, "device": device, "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                      "k": a.k, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                      "disable_by_batch_size": a.disable_by_batch_size,
                      "load_and_capture_s": round(time.perf_counter() - t0, 1)}), flush=True)
    table, mismatched = [], 0
    for b in a.batches:
        ids = make_prompts(b, a.prompt_tokens, worker.model_cfg.vocab_size)
        plain = timed(cfg, worker, ids, a, blocks)
        oracle = oracles(plain["tokens"])
        runs = {"plain": plain, "spec": timed(speculating(cfg, a.k), worker, ids, a, blocks,
                                              oracle)}
        if a.disable_by_batch_size and b >= a.disable_by_batch_size:
            runs["adaptive"] = timed(speculating(cfg, a.k, a.disable_by_batch_size), worker,
                                     ids, a, blocks, oracle)
        row = {}
        for mode, r in runs.items():
            row[mode] = summary(b, mode, r, plain)
            mismatched += row[mode]["mismatched_seqs"]
            print(json.dumps(row[mode]), flush=True)
        table.append(row)
    context = a.prompt_tokens + a.max_tokens // 2
    for b, row in zip(a.batches, table):
        step = {f"{name}_ms": round(1e3 * time_worker(worker, b, context, BLOCK, a.iters, v), 3)
                for name, v in (("decode", 0), ("verify", a.k))}
        row["step"] = {"batch": b, "timing": "direct: Worker.execute, plan to host tokens",
                       "context": context, "verify_tokens": 1 + a.k, **step,
                       "verify_over_decode": round(step["verify_ms"] / step["decode_ms"], 3)}
        print(json.dumps(row["step"]), flush=True)
    print_table(table, a.k)
    return mismatched


def print_table(table: list[dict], k: int) -> None:
    print(f"\n| batch | plain tok/s | spec tok/s | spec/plain (decode) | adaptive tok/s | "
          f"adaptive/plain | adaptive/spec | acceptance | tokens differ | decode ms | "
          f"verify 1+{k} ms | verify/decode |")
    print("|---" * 12 + "|")
    for row in table:
        p, s, ad, st = row["plain"], row["spec"], row.get("adaptive"), row["step"]
        adaptive = (f"{ad['tok_s']} | {ad['speedup']}x | "
                    f"{round(ad['tok_s'] / s['tok_s'], 3)}x" if ad else "- | - | -")
        differ = s["mismatched_seqs"] + (ad["mismatched_seqs"] if ad else 0)
        print(f"| {p['batch']} | {p['tok_s']} | {s['tok_s']} | {s['speedup']}x "
              f"({s['decode_speedup']}x) | {adaptive} | {s['acceptance']} | {differ} | "
              f"{st['decode_ms']} | {st['verify_ms']} | {st['verify_over_decode']}x |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--load", choices=["code", "pydoc"], default="code")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--oracle", action="store_true",
                   help="draft the target's own greedy tokens, recorded by a plain run")
    p.add_argument("--preset", default="", help="oracle: a bench.checkpoints preset (not --model)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: the preset's config.json only, weights drawn on the device")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--disable-by-batch-size", type=int, default=0,
                   help="oracle: also run batches >= N with drafts off from N sequences")
    p.add_argument("--iters", type=int, default=50, help="oracle: timed steps per figure")
    a = p.parse_args()
    device = a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if not a.oracle:
        ngram_main(a, device)
        return
    mismatched = oracle_main(a, device)
    if mismatched:
        sys.exit(f"{mismatched} requests' greedy tokens differ from the plain run's")


if __name__ == "__main__":
    main()
