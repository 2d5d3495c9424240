"""Train raygraph's built-in default model: a tiny Llama trained on CPython's pydoc topics.

The corpus is ``pydoc_data.topics.topics`` (the help() topic text shipped with
Python, PSF license). The script trains a byte-level BPE tokenizer and a
~5 M parameter ``LlamaForCausalLM`` (with grouped-query attention) on CPU, saves
both in bfloat16 to ``raygraph/assets/default_model/`` and writes a README.

Usage::

    python scripts/train_default_model.py --steps 650 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
VOCAB_SIZE = 4096
PROMPTS = ["The import statement", "A class definition", "The for statement"]
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "raygraph" / "assets" / "default_model"


def normalise(text: str) -> str:
    """Tidy one topic: strip trailing spaces, cap indentation, collapse blank runs."""
    lines = []
    for line in text.replace("\t", "    ").splitlines():
        body = line.lstrip(" ")
        indent = min(len(line) - len(body), 8)
        body = re.sub(r"(?<=\S) {2,}", " ", body.rstrip())  # drop alignment padding
        lines.append(" " * indent + body if body else "")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def load_corpus() -> list[str]:
    """Return the normalised pydoc topic texts, sorted by topic key."""
    return [normalise(topics[key]) for key in sorted(topics)]


def train_tokenizer(docs: list[str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer whose post-processor adds BOS (as AutoTokenizer
    does with tokenizer_config.json's add_bos_token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, PAD_ID]
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)])
    return tok


def build_model() -> LlamaForCausalLM:
    """Build the small GQA Llama (4 layers, 4 query heads, 2 KV heads)."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, data: torch.Tensor, args: argparse.Namespace) -> float:
    """Plain fp32 AdamW loop on random windows; returns mean loss of the last 10% of steps."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=False
    )
    warmup = max(1, min(args.warmup, args.steps // 5))
    tail = max(1, args.steps // 10)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    for step in bar:
        starts = torch.randint(0, len(data) - args.seq_len, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + args.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        loss = model(input_ids=batch, labels=batch).loss  # HF shifts labels internally
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    return sum(losses[-tail:]) / tail


def sample(model: LlamaForCausalLM, tok: Tokenizer, seed: int) -> dict[str, dict[str, str]]:
    """Greedy and temperature-0.7 continuations of PROMPTS (BOS first)."""
    model.eval()
    out: dict[str, dict[str, str]] = {}
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])  # BOS from the post-processor
        texts = {}
        for name, kwargs in (
            ("greedy", {"do_sample": False}),
            ("t0.7", {"do_sample": True, "temperature": 0.7, "top_k": 0}),
        ):
            torch.manual_seed(seed)
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=60, pad_token_id=PAD_ID, **kwargs)
            texts[name] = tok.decode(gen[0, 1:].tolist())
        out[prompt] = texts
    return out


def write_readme(out_dir: Path, info: dict[str, object], greedy: str) -> None:
    """Write the asset's README.md (what it is, data + license, command, loss, a sample)."""
    text = f"""# raygraph default model

A tiny Llama-architecture causal LM ({info["params"]:,} parameters, GQA with
4 query / 2 key-value heads, 4 layers, hidden 256, vocab 4096, bfloat16 weights)
used as raygraph's built-in model for tests, demos and benchmarks. It is a toy:
it produces Python-documentation-flavoured text, nothing more.

- Data: the `pydoc_data.topics` text shipped with CPython {info["python"]}
  (the `help()` topics), sorted by key, whitespace-normalised, documents
  separated by `<|eos|>`. License: Python Software Foundation License.
- Tokenizer: byte-level BPE (`tokenizers`), specials `<|bos|>`=0, `<|eos|>`=1,
  `<|pad|>`=2; the post-processor adds BOS (`add_bos_token` in tokenizer_config.json).
- Training: {info["steps"]} AdamW steps x {info["batch_size"]} windows of
  {info["seq_len"]} tokens, peak lr {info["lr"]}, warmup + cosine, fp32 on CPU
  ({info["threads"]} threads, {info["train_seconds"]:.0f} s).
- Final training loss (mean of last 10% of steps): {info["final_loss"]:.3f}

Made with:

    {info["command"]}

Greedy sample (BOS + "{PROMPTS[0]}"):

```text
{greedy}
```
"""
    (out_dir / "README.md").write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=650)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    docs = load_corpus()
    tok = train_tokenizer(docs)
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc, add_special_tokens=False).ids + [EOS_ID]
    data = torch.tensor(ids, dtype=torch.long)
    print(f"corpus: {len(docs)} topics, {sum(map(len, docs)):,} chars, {len(data):,} tokens")

    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")
    t0 = time.perf_counter()
    final_loss = train(model, data, args)
    train_seconds = time.perf_counter() - t0
    print(f"trained {args.steps} steps in {train_seconds:.0f} s, final loss {final_loss:.4f}")

    model.config.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(args.out_dir, safe_serialization=True)
    tok.save(str(args.out_dir / "tokenizer.json"))
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, max_new_tokens=64
    ).save_pretrained(args.out_dir)

    reloaded = LlamaForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32)
    samples = sample(reloaded, Tokenizer.from_file(str(args.out_dir / "tokenizer.json")), args.seed)
    for prompt, texts in samples.items():
        for name, text in texts.items():
            print(f"--- {prompt!r} [{name}]\n{text}\n")

    info = {
        "params": n_params,
        "python": sys.version.split()[0],
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "threads": args.threads,
        "train_seconds": train_seconds,
        "final_loss": final_loss,
        "command": "python scripts/train_default_model.py " + " ".join(sys.argv[1:]),
    }
    write_readme(args.out_dir, info, samples[PROMPTS[0]]["greedy"])
    print(json.dumps({k: v for k, v in info.items() if k != "command"}, default=str))


if __name__ == "__main__":
    main()
