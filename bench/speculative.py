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
(OracleProposer) while the request's tokens equal the recorded ones, so acceptance is ~100%
and the speedup is the most k drafts can give.

    python -m bench.speculative --oracle [--preset llama3-8b --load-format dummy]
        [--dtype auto|bfloat16|float32] [--batches 1 64 256] [--step-batches 1 64]
        [--k 4] [--prompt-tokens 128] [--max-tokens 256] [--disable-by-batch-size N]
        [--keep-drafts] [--repeats 3]

--keep-drafts: the workers keep every draft whatever their greedy tokens (and the proposer
drafts by position): the loop timed at 100% acceptance where the verify and decode kernels
pick different greedy tokens (bf16 on random weights); tokens are then not compared.

--draft PRESET|DIR|eagle3: the speculative runs draw their drafts from a draft model or an
EAGLE-3 head on the worker (methods "draft" and "eagle3", worker/drafter.py; a
bench.checkpoints preset follows --load-format; eagle3: a head of the target preset's
shape, dummy weights) instead of the oracle; the plain runs and the direct step timings
run without it. With random weights its drafts rarely hold: --keep-drafts times the loop,
the drafter's work included, at 100% acceptance.

First the direct step timing per --step-batches (default --batches): Worker.execute of a
hand-built step (decode_step's plans: every sequence at prompt + max_tokens / 2 cached
tokens) computing 1 token against 1 + k (a verify step), median seconds from the plan to
the tokens on the host. Then per batch (that many concurrent requests, random prompt tokens
seeded by the batch size): output tok/s plain, speculating, and, at batches >= N,
speculating with disable_by_batch_size = N ("adaptive": no drafts from N running
sequences). tok_s is over the whole run, decode_tok_s from the step at which every request
has its first token. Prints one JSON line per timing and per run, then tables.

A verify step runs the multi-token kernels, a decode step the decode kernels: in bfloat16
they may pick different greedy tokens where logits nearly tie (random dummy weights: often),
after which a request's tokens follow another path. So each run reports its agreement with
plain (the share of requests with equal tokens, the mean equal prefix), and a difference
fails the run (exit 1) only in float32, where the two paths agree.
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

from bench.checkpoints import PRESETS, bench_model, write_eagle3_config
from bench.decode_step import time_worker
from bench.serving import make_prompts
from raygraph.config import (
    DEFAULT_MODEL,
    CacheConfig,
    GraphConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from raygraph.engine.core import EngineCore, local_dispatch
from raygraph.engine.drafts import ModelDrafts
from raygraph.engine.ngram import NgramIndex
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams
from raygraph.tokenizer import load_tokenizer
from raygraph.worker.speculative import emitted
from raygraph.worker.worker import Worker

BLOCK = 16  # KV block size (tokens)
# (request index, prompt) -> the request's proposer: NgramIndex's interface (extend, propose)
Proposer = Callable[[int, list[int]], Any]


class OracleProposer:
    """Drafts the target's own greedy continuation, recorded by a plain run: the next k
    recorded tokens after the sequence's current length, while its outputs so far equal the
    recorded ones. Once they differ (a verify step's kernels may pick another greedy token
    than a decode step's) the recording says nothing about what follows: it proposes
    nothing from then on."""

    asks = False  # proposes here, not on the workers

    def __init__(self, prompt_len: int, recorded: list[int], follow: bool = True) -> None:
        self.prompt_len = prompt_len
        self.recorded = recorded
        self.follow = follow  # False: propose by position even once the outputs differ
        self.num_tokens = 0  # prompt and outputs so far, as extend() gave them
        self.diverged = False

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            at = self.num_tokens - self.prompt_len  # the output index of `token`
            if self.follow and at >= 0 and self.recorded[at : at + 1] != [token]:
                self.diverged = True
            self.num_tokens += 1

    def propose(self, k: int) -> list[int]:
        at = self.num_tokens - self.prompt_len  # outputs so far
        if k <= 0 or at < 0 or self.diverged:
            return []
        return self.recorded[at : at + k]


def oracles(recorded: list[list[int]], follow: bool = True) -> Proposer:
    """Request i's proposer: an OracleProposer over recorded[i]."""
    return lambda i, prompt: OracleProposer(len(prompt), recorded[i], follow)


def keep_every_draft(tokens: list[int], targets: list[int],
                     verify: list[tuple[int, int, list[int]]]) -> tuple[list[int], list[int]]:
    """worker.speculative.emitted as if every draft held: a verifying chunk emits its drafts
    and the target's token after them. A timing bound (--keep-drafts): a step costs the
    same whatever it keeps, so this times the loop at 100% acceptance where the kernels of
    a verify and a decode step pick different greedy tokens (bf16, random weights)."""
    agreeing = list(targets)
    for _, row, drafts in verify:
        agreeing[row: row + len(drafts)] = drafts
    return emitted(tokens, agreeing, verify)


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
            seq.proposer = proposer(seq.seq_id, seq.prompt_token_ids)
            seq.proposer.extend(seq.prompt_token_ids)
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
            "drafts": sched.num_draft_tokens, "kept": sched.num_accepted_tokens,
            "waits": core.turnaround.waits, "declined": core.turnaround.declined,
            "turnarounds": core.turnaround.measured,
            "turnaround_ms": round(1e3 * core.turnaround.median_s(), 3)}


def speculating(cfg: ServeConfig, k: int, disable_by_batch_size: int = 0,
                draft: str = "") -> ServeConfig:
    """Speculation by n-gram lookup, or by the draft model or EAGLE-3 head at `draft`."""
    method = ("" if not draft else "eagle3"
              if ModelConfig.from_pretrained(draft).family == "eagle3" else "draft")
    return msgspec.structs.replace(cfg, speculative=SpeculativeConfig(
        method=method or "ngram", model=draft, num_speculative_tokens=k,
        disable_by_batch_size=disable_by_batch_size))


def ngram_main(a: argparse.Namespace, device: str) -> None:
    tok = load_tokenizer(a.model)
    room = ModelConfig.from_pretrained(a.model).max_position_embeddings - a.max_tokens - 16
    ids = [i for i in map(tok.encode, prompts(a.load)) if len(i) <= room][: a.requests]
    longest = max(len(i) for i in ids) + a.max_tokens + 16
    blocks = len(ids) * -(-longest // BLOCK) + 8
    cfg = ServeConfig(model=a.model, device=device, dtype=a.dtype,
                      cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=max(8, len(ids) * (a.k + 1)),
                                                max_num_batched_tokens=2048,
                                                max_model_len=longest))
    spec_cfg = speculating(cfg, a.k)
    worker = make_worker(spec_cfg, blocks)  # its decode graphs verify drafts as rows
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
    """A short untimed run first (shapes first seen compile or autotune), then --repeats
    runs, of which the median by time: a run of about a second moves 5-10% from one to the
    next on a GPU."""
    run(cfg, worker, ids, min(16, a.max_tokens), blocks, proposer)
    runs = sorted((run(cfg, worker, ids, a.max_tokens, blocks, proposer)
                   for _ in range(a.repeats)), key=lambda r: r["seconds"])
    median = runs[len(runs) // 2]
    # greedy runs of one batch give the same tokens: a repeat that did not is reported
    median["repeats_differing"] = sum(r["tokens"] != median["tokens"] for r in runs)
    return median


def agreement(tokens: list[list[int]], plain: list[list[int]]) -> dict:
    """How far a run's greedy tokens follow the plain run's: the share of requests whose
    tokens are all equal, and the mean length of the equal prefix."""
    pairs = list(zip(tokens, plain, strict=True))
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in pairs]
    equal = sum(x == y for x, y in pairs)
    return {"mismatched_seqs": len(pairs) - equal, "agreement": round(equal / len(pairs), 4),
            "matching_prefix_mean": round(sum(prefixes) / len(pairs), 2)}


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
            "repeats_differing": r.get("repeats_differing", 0),
            **agreement(r["tokens"], plain["tokens"])}


def step_timing(worker: Worker, batch: int, context: int, k: int, iters: int) -> dict:
    """A decode step (1 token a sequence) against a verify step (1 + k) at `batch`: as
    decode rows (the decode buckets and kernel), and prefill-shaped (the prefill buckets and
    kernel, as a verify step past the largest decode bucket runs)."""
    def ms(verify: int) -> float:
        return round(1e3 * time_worker(worker, batch, context, BLOCK, iters, verify), 3)

    ex = worker.executor
    step = {"decode_ms": ms(0), "verify_ms": ms(k)}
    rows, ex.max_decode_rows = ex.max_decode_rows, 0  # every verify step prefill-shaped
    try:
        step["verify_prefill_shaped_ms"] = ms(k)
    finally:
        ex.max_decode_rows = rows
    return {"batch": batch, "timing": "direct: Worker.execute, plan to host tokens",
            "context": context, "verify_tokens": 1 + k, **step,
            "verify_over_decode": round(step["verify_ms"] / step["decode_ms"], 3),
            "prefill_shaped_over_decode": round(step["verify_prefill_shaped_ms"]
                                                / step["decode_ms"], 3)}


def oracle_main(a: argparse.Namespace, device: str) -> int:
    """The direct step timings, then every batch's plain, speculating and adaptive runs, on
    one worker; returns the requests whose tokens differed from plain where that is a fault
    (float32: the verify and decode kernels agree), else 0."""
    model = bench_model(a.preset, a.load_format) if a.preset else a.model
    draft = (str(write_eagle3_config(f"{model}-eagle3", a.preset)) if a.draft == "eagle3"
             else bench_model(a.draft, a.load_format) if a.draft in PRESETS else a.draft)
    step_batches = a.batches if a.step_batches is None else a.step_batches
    top = max(a.batches + step_batches)
    longest = a.prompt_tokens + a.max_tokens + a.k + BLOCK
    blocks = top * -(-longest // BLOCK) + 8
    # a logits row per sequence and draft: max_num_seqs and the token budget let every
    # request verify k drafts in the same step
    rows = top * (a.k + 1)
    cfg = ServeConfig(model=model, device=device, dtype=a.dtype, load_format=a.load_format,
                      cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=rows,
                                                max_num_batched_tokens=max(2048, rows),
                                                max_model_len=longest),
                      graph=GraphConfig(max_decode=rows))  # verify rows in decode buckets
    dtype = cfg.weights_dtype(device)
    t0 = time.perf_counter()
    spec_cfg = speculating(cfg, a.k, draft=draft)
    worker = make_worker(spec_cfg, blocks)  # decode graphs verify drafts as rows
    drafter, worker.drafter = worker.drafter, None  # attached for the speculative runs only
    print(json.dumps({"model": model, "device": device, "dtype": dtype,
                      "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                      "k": a.k, "draft": draft or None,
                      "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                      "disable_by_batch_size": a.disable_by_batch_size,
                      "load_and_capture_s": round(time.perf_counter() - t0, 1)}), flush=True)
    steps = {}
    for b in step_batches:
        steps[b] = step_timing(worker, b, a.prompt_tokens + a.max_tokens // 2, a.k, a.iters)
        print(json.dumps(steps[b]), flush=True)
    table, mismatched = [], 0
    if a.keep_drafts:
        import raygraph.worker.worker as worker_module

        worker_module.emitted = keep_every_draft
    for b in a.batches:
        ids = make_prompts(b, a.prompt_tokens, worker.model_cfg.vocab_size)
        plain = timed(cfg, worker, ids, a, blocks)
        proposer = (oracles(plain["tokens"], follow=not a.keep_drafts) if not draft
                    else lambda i, p: ModelDrafts())
        worker.drafter = drafter
        runs = {"plain": plain, "spec": timed(spec_cfg, worker, ids, a, blocks, proposer)}
        if a.disable_by_batch_size and b >= a.disable_by_batch_size:
            runs["adaptive"] = timed(speculating(cfg, a.k, a.disable_by_batch_size, draft),
                                     worker, ids, a, blocks, proposer)
        worker.drafter = None
        row = {}
        for mode, r in runs.items():
            row[mode] = summary(b, mode, r, plain)
            mismatched += row[mode]["mismatched_seqs"] + row[mode]["repeats_differing"]
            print(json.dumps(row[mode]), flush=True)
        table.append(row)
    print_steps(list(steps.values()), a.k)
    print_table(table)
    return mismatched if dtype == "float32" and not a.keep_drafts else 0


def print_steps(steps: list[dict], k: int) -> None:
    if not steps:
        return
    print(f"\n| batch | decode ms | verify 1+{k} ms | verify/decode | prefill-shaped ms | "
          "prefill-shaped/decode |")
    print("|---" * 6 + "|")
    for st in steps:
        print(f"| {st['batch']} | {st['decode_ms']} | {st['verify_ms']} | "
              f"{st['verify_over_decode']}x | {st['verify_prefill_shaped_ms']} | "
              f"{st['prefill_shaped_over_decode']}x |")


def print_table(table: list[dict]) -> None:
    print("\n| batch | plain tok/s | spec tok/s | spec/plain (decode) | adaptive tok/s | "
          "adaptive/plain | adaptive/spec | acceptance | equal to plain | matching prefix |")
    print("|---" * 10 + "|")
    for row in table:
        p, s, ad = row["plain"], row["spec"], row.get("adaptive")
        adaptive = (f"{ad['tok_s']} | {ad['speedup']}x | "
                    f"{round(ad['tok_s'] / s['tok_s'], 3)}x" if ad else "- | - | -")
        agree = f"{s['agreement']}" + (f" / {ad['agreement']}" if ad else "")
        prefix = f"{s['matching_prefix_mean']}" + (f" / {ad['matching_prefix_mean']}"
                                                   if ad else "")
        print(f"| {p['batch']} | {p['tok_s']} | {s['tok_s']} | {s['speedup']}x "
              f"({s['decode_speedup']}x) | {adaptive} | {s['acceptance']} | {agree} | "
              f"{prefix} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--load", choices=["code", "pydoc"], default="code")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="the weights' and activations' (auto: as serving picks it); only in "
                        "float32 do tokens that differ from plain fail the run")
    p.add_argument("--oracle", action="store_true",
                   help="draft the target's own greedy tokens, recorded by a plain run")
    p.add_argument("--preset", default="", help="oracle: a bench.checkpoints preset (not --model)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: the preset's config.json only, weights drawn on the device")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--disable-by-batch-size", type=int, default=0,
                   help="oracle: also run batches >= N with drafts off from N sequences")
    p.add_argument("--step-batches", type=int, nargs="*", default=None,
                   help="oracle: batches of the direct step timings (default: --batches; "
                        "none: no timings)")
    p.add_argument("--iters", type=int, default=50, help="oracle: timed steps per figure")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each batch and mode (odd: the median is reported)")
    p.add_argument("--draft", default="",
                   help="oracle: drafts from this draft model or EAGLE-3 head (a preset, a "
                        "checkpoint directory, or eagle3: a dummy head for --preset) instead "
                        "of the oracle")
    p.add_argument("--keep-drafts", action="store_true",
                   help="oracle: the workers keep every draft (timing at 100%% acceptance; "
                        "tokens not checked)")
    a = p.parse_args()
    if a.repeats < 1 or a.repeats % 2 == 0:
        p.error(f"--repeats must be odd and positive (a median run), got {a.repeats}")
    device = a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if not a.oracle:
        ngram_main(a, device)
        return
    mismatched = oracle_main(a, device)
    if mismatched:
        sys.exit(f"{mismatched} requests' greedy tokens (or repeats' runs) differ from the "
                 "plain run's in float32")


if __name__ == "__main__":
    main()
