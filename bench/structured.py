"""Structured outputs' cost: the compile time of each of 50 JSON schemas' grammars (p50,
p99), and a batch's decode step with no row constrained, every row, or half, side by side
in one process (EngineCore over an in-process Worker, as `tests/test_served_loop.py` runs
it: tokens fed on the device, replies a step late).

    python -m bench.structured [--preset llama3-8b | --model DIR] [--batch 64] [--steps 48]
        [--synthetic-vocab 128256]

Grammars use the built-in model's tokenizer (4,096 tokens; the bench checkpoints have none),
or with `--synthetic-vocab N` a made-up one of N tokens, for the mask cost of a Llama 3
sized vocabulary (masks are filled on the worker while the forward runs). Constrained
rows follow a grammar that never ends (`[a-z ]+` then "END"), so no row stops early; the
figures are each kind of row's time per output token while the whole batch decodes, after
a warm-up run; the unconstrained figure is the mean of a run before and one after the others.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import tempfile
import time

import torch

from raygraph.config import DEFAULT_MODEL, CacheConfig, SchedulerConfig, ServeConfig
from raygraph.engine.core import EngineCore, local_dispatch
from raygraph.engine.pages import PagePool
from raygraph.engine.scheduler import Scheduler
from raygraph.engine.sequence import Sequence
from raygraph.grammar import Grammars
from raygraph.protocol import SamplingParams, StructuredOutputs
from raygraph.tokenizer import load_tokenizer
from raygraph.worker.worker import Worker

NAME = {"type": "string", "maxLength": 12}
SHORT = {"type": "string", "minLength": 1, "maxLength": 6}
COLOR = {"enum": ["red", "green", "blue"]}
INT = {"type": "integer", "minimum": -5, "maximum": 99}
# a number's digits are unbounded in JSON: multipleOf bounds them, so a small model's
# greedy "0.000..." cannot run to max_tokens
NUM = {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01}
ENDLESS = 'start: /[a-z ]+/ "END"\n'  # no EOS until "END": rows keep decoding


def obj(props: dict, required: list | None = None, closed: bool = True) -> dict:
    out = {"type": "object", "properties": props,
           "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


def arr(items: dict, lo: int = 0, hi: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def schemas() -> list[dict]:
    """50 schemas: nested objects and arrays, item bounds, enums, anyOf/oneOf, $defs/$ref,
    patterns, numeric bounds, required and optional fields, closed objects."""
    base = [
        obj({"name": NAME, "age": INT}),
        obj({"name": NAME, "age": INT}, required=["name"]),
        obj({"color": COLOR, "count": INT}),
        obj({"tags": arr(SHORT, 1, 3)}),
        obj({"point": obj({"x": NUM, "y": NUM})}),
        obj({"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 8}}),
        obj({"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"}}),
        obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": NAME}),
        obj({"v": {"anyOf": [INT, COLOR]}}),
        obj({"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                             {"type": "string", "enum": ["none"]}]}}),
        {"$defs": {"p": obj({"x": INT, "y": INT})}, **obj({"a": {"$ref": "#/$defs/p"},
                                                           "b": {"$ref": "#/$defs/p"}})},
        {"$defs": {"item": obj({"name": SHORT, "qty": INT})},
         **obj({"items": arr({"$ref": "#/$defs/item"}, 1, 2)})},
        obj({"grid": arr(arr(INT, 1, 2), 1, 2)}),
        obj({"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"const": "fixed"}}),
        obj({"score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10,
                       "multipleOf": 0.5}}),
        obj({"user": obj({"name": NAME, "roles": arr(COLOR, 0, 2)}),
             "active": {"type": "boolean"}}),
        arr(INT, 2, 4),
        arr(obj({"k": SHORT}), 1, 2),
        {"type": "string", "enum": ["alpha", "beta", "gamma"]},
        {"type": "integer", "minimum": 10, "maximum": 20},
        obj({"a": INT, "b": INT, "c": INT}, required=["a"]),
        obj({"meta": {"type": "object", "additionalProperties": {"type": "integer"},
                      "maxProperties": 2}}),
        obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
        obj({"nested": obj({"deeper": obj({"deepest": COLOR})})}),
        obj({"pair": {"type": "array", "prefixItems": [INT, COLOR], "items": False}}),
    ]
    rng = random.Random(0)
    leaves = [NAME, SHORT, COLOR, INT, NUM, {"type": "boolean"}, arr(INT, 0, 2),
              {"anyOf": [INT, {"type": "null"}]}]
    while len(base) < 50:  # random closed objects of the building blocks above
        props = {f"f{i}": rng.choice(leaves) for i in range(rng.randint(1, 4))}
        required = [k for k in props if rng.random() < 0.7]
        base.append(obj(props, required))
    return base


def compile_ms(grammars: Grammars) -> list[float]:
    """Each schema's compile time, uncached (the compiler's own work, not the cache)."""
    out = []
    for s in schemas():
        t0 = time.perf_counter()
        grammars._matcher(StructuredOutputs("json", json.dumps(s)))
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def itl_ms(worker, grammars: Grammars, vocab: int, batch: int, steps: int,
           constrained: int) -> dict[str, float]:
    """Time per output token of a free row and of a constrained row (ms) while the whole
    batch decodes, `constrained` of its rows guided: the time from the first decode step
    with every row running to the first row's end, over each kind's tokens per row."""
    bs, prompt = 16, 16
    blocks = batch * -(-(prompt + steps + 8) // bs) + 8
    sched = Scheduler(PagePool(blocks, bs), batch, batch * prompt, prompt + steps + 64, ())
    spec = StructuredOutputs("grammar", ENDLESS)
    rng = random.Random(0)
    seqs = []
    for i in range(batch):
        guided = i < constrained
        sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True,
                            structured=spec if guided else None).resolved()
        seq = Sequence(i, [rng.randrange(3, vocab) for _ in range(prompt)], sp)
        if guided:
            seq.guide = grammars.guide(spec)
        sched.add(seq)
        seqs.append(seq)
    core, local = EngineCore([sched], None, ep=False), local_dispatch(worker)
    device = [0, 0.0, 0.0]  # steps, the device's time in them and idle between them (s)

    def dispatch(msgs: list[bytes]) -> list:
        outs = local(msgs)
        for o in outs:
            if o.step_id >= 0:
                device[:] = device[0] + 1, device[1] + o.forward_s, device[2] + o.idle_s
        return outs

    start = end = None
    while core.step(dispatch) is not None:  # to the end: the worker is left with nothing
        if end is None and any(s.finish_reason for s in seqs):
            end = time.perf_counter(), [len(s.output_token_ids) for s in seqs], list(device)
        if start is None and all(len(s.output_token_ids) >= 2 for s in seqs):
            start = time.perf_counter(), [len(s.output_token_ids) for s in seqs], list(device)
    elapsed = end[0] - start[0]
    made = [b - a for a, b in zip(start[1], end[1])]
    steps = max(1, end[2][0] - start[2][0])
    out = {"device_ms_per_step": round(1e3 * (end[2][1] - start[2][1]) / steps, 3),
           "device_idle_ms_per_step": round(1e3 * (end[2][2] - start[2][2]) / steps, 3)}
    for name, rows in (("free", made[constrained:]), ("guided", made[:constrained])):
        if rows:
            out[f"{name}_itl_ms"] = round(1e3 * elapsed / statistics.mean(rows), 3)
    return out


def synthetic_tokenizer(size: int, path: str) -> str:
    """A byte-level BPE tokenizer of `size` tokens saved at `path`: the 256 bytes, then
    random lowercase words of 2-9 letters (half with a leading space, a tenth capitalised)
    and an EOS. It tokenizes nothing well; it gives a grammar a vocabulary of that size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    rng = random.Random(0)
    while len(vocab) < size - 1:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        word = ("\u0120" if rng.random() < 0.5 else "") + word  # byte-level's space
        vocab.setdefault(word.capitalize() if rng.random() < 0.1 else word, len(vocab))
    vocab["<|eos|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="random-weight checkpoint (bench/checkpoints.py)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--synthetic-vocab", type=int, default=0,
                   help="grammars over a made-up tokenizer of this many tokens (a Llama 3 "
                        "sized vocabulary costs more per mask) instead of the built-in one's")
    a = p.parse_args()
    model = a.model or DEFAULT_MODEL
    if a.preset:
        from bench.checkpoints import bench_model

        model = bench_model(a.preset, "auto")
    tokenizer = DEFAULT_MODEL
    if a.synthetic_vocab:
        tokenizer = synthetic_tokenizer(a.synthetic_vocab, tempfile.mkdtemp())
    grammars = Grammars(load_tokenizer(tokenizer).hf)
    times = sorted(compile_ms(grammars))
    print(json.dumps({"schemas": len(times), "compile_ms_p50": round(times[len(times) // 2], 2),
                      "compile_ms_p99": round(times[int(0.99 * (len(times) - 1))], 2),
                      "compile_ms_max": round(times[-1], 2),
                      "tokenizer_vocab": grammars.vocab}), flush=True)
    device = a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    blocks = a.batch * -(-(16 + a.steps + 8) // 16) + 8
    cfg = ServeConfig(model=model, tokenizer=tokenizer, device=device,
                      cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=a.batch,
                                                max_num_batched_tokens=a.batch * 16))
    worker = Worker(cfg, 0)
    worker.load(("127.0.0.1", 0))
    worker.allocate_kv_cache(blocks)
    worker.capture_all()
    vocab = min(grammars.vocab, worker.model_cfg.vocab_size)
    row = {"model": a.preset or model, "device": device, "batch": a.batch}
    itl_ms(worker, grammars, vocab, a.batch, a.steps, a.batch // 2)  # warm-up, not counted
    for name, n in (("none", 0), ("all", a.batch), ("half", a.batch // 2), ("none", 0)):
        for k, v in itl_ms(worker, grammars, vocab, a.batch, a.steps, n).items():
            key = f"{name}_{k}" if k.startswith("device") else f"{name}_constrained_{k}"
            row[key] = round((row[key] + v) / 2, 3) if key in row else v  # none: both runs
    base = row["none_constrained_free_itl_ms"]
    row["all_vs_none"] = round(row["all_constrained_guided_itl_ms"] / base, 2)
    row["half_free_vs_none"] = round(row["half_constrained_free_itl_ms"] / base, 2)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
