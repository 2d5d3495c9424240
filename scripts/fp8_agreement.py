"""How close `--quantization fp8` (and `--kv-cache-dtype fp8`) stays to the unquantized
model: top-1 agreement of the next token under teacher forcing, and perplexity, over a text
in windows of 256 tokens (CPU, float32 activations). tests/test_fp8_online.py and
tests/test_fp8_kv.py assert on the same measure.

--as-served P computes the compared model's logits as serving does: each window's first P
tokens in one prefill step (past DECODE_ROWS rows its GEMMs round activations to e4m3),
then every later token in a decode step of its own (one row: activations as they are),
and compares the predictions of the decoded tokens.

    python scripts/fp8_agreement.py FILE [--model DIR] [--windows N] [--kv-cache-dtype fp8]
        [--quantization auto|fp8] [--as-served P]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from raygraph.config import DEFAULT_MODEL, ServeConfig
from raygraph.graph.inputs import batch_from, host_inputs
from raygraph.model.context import forward_context
from raygraph.model.loader import build_model
from raygraph.model.ops import FP8_KV
from raygraph.model.parallel import Comm
from raygraph.protocol import SeqChunk, StepPlan

CPU = torch.device("cpu")
WINDOW = 256  # the default model's training windows
BLOCK = 16


@dataclass(frozen=True)
class Agreement:
    tokens: int  # next-token predictions compared
    top1: float  # share whose argmax equals the reference's
    ppl_ref: float
    ppl_fp8: float


def cpu_model(model: str, quantization: str) -> torch.nn.Module:
    cfg = ServeConfig(model=model, quantization=quantization).model_cfg()
    return build_model(cfg, Comm(), torch.float32, CPU)


def logits(model: torch.nn.Module, ids: list[int], kv_dtype: torch.dtype = torch.float32,
           prompt: int = 0) -> torch.Tensor:
    """[len(ids), vocab]: every position's next-token logits, over a fresh paged cache of
    `kv_dtype` (a prompt's keys are stored before any query reads them, so an FP8 cache
    rounds every key and value a query sees, as in serving). prompt > 0: the first `prompt`
    tokens in one step, then each later one in a step of its own (decode steps)."""
    cfg = model.config
    blocks = list(range(-(-len(ids) // BLOCK)))
    for layer in model.attention_layers():
        shape = (len(blocks) + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=kv_dtype)
        layer.v_cache = torch.zeros(shape, dtype=kv_dtype)
    steps = [(0, ids)] if prompt <= 0 else \
        [(0, ids[:prompt])] + [(t, ids[t: t + 1]) for t in range(prompt, len(ids))]
    out = []
    for start, chunk in steps:
        plan = StepPlan(0, [SeqChunk(0, chunk, start, blocks, False)])
        batch = batch_from(host_inputs(plan, BLOCK), CPU)
        with torch.no_grad(), forward_context(batch.ctx):
            out.append(model.compute_logits(model(batch.input_ids, batch.positions)))
    return torch.cat(out)


def windows(text: str, model: str = DEFAULT_MODEL, limit: int | None = None) -> list[list[int]]:
    ids = Tokenizer.from_file(f"{model}/tokenizer.json").encode(text).ids
    out = [ids[i: i + WINDOW] for i in range(0, len(ids) - 16, WINDOW)]
    return out[:limit]


def agreement(ref: torch.nn.Module, fp8: torch.nn.Module, seqs: list[list[int]],
              kv_dtype: torch.dtype = torch.float32, as_served: int = 0) -> Agreement:
    """`fp8` (its KV cache in `kv_dtype`) against `ref` (float32 KV cache). as_served > 0:
    `fp8` computes as serving does after a prompt of that many tokens (`logits`), and only
    the positions it decoded are compared."""
    same = total = 0
    nll_ref = nll_fp8 = 0.0
    first = max(as_served - 1, 0)  # the prompt's last position predicts the first decoded
    for ids in seqs:
        want = logits(ref, ids)[first:-1]
        got = logits(fp8, ids, kv_dtype, as_served)[first:-1]
        target = torch.tensor(ids[first + 1:])
        same += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += len(target)
        nll_ref += F.cross_entropy(want, target, reduction="sum").item()
        nll_fp8 += F.cross_entropy(got, target, reduction="sum").item()
    return Agreement(total, same / total, math.exp(nll_ref / total), math.exp(nll_fp8 / total))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text", help="a UTF-8 text file")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--windows", type=int, default=None, help="at most this many windows")
    p.add_argument("--quantization", choices=["auto", "fp8"], default="fp8",
                   help="the compared model's weights and activations (default: fp8)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the compared model's KV cache (default: float32, as the reference)")
    p.add_argument("--as-served", type=int, default=0, metavar="P",
                   help="prefill P tokens, then decode the rest a token a step; compare the "
                        "decoded positions (default: 0, the whole window in one step)")
    a = p.parse_args()
    with open(a.text, encoding="utf-8") as f:
        seqs = windows(f.read(), a.model, a.windows)
    kv = FP8_KV if a.kv_cache_dtype == "fp8" else torch.float32
    r = agreement(cpu_model(a.model, "auto"), cpu_model(a.model, a.quantization), seqs, kv,
                  a.as_served)
    print(f"{r.tokens} tokens: top-1 agreement {r.top1:.2%}; perplexity {r.ppl_ref:.3f} -> "
          f"{r.ppl_fp8:.3f} ({r.ppl_fp8 / r.ppl_ref - 1:+.2%})")


if __name__ == "__main__":
    main()
