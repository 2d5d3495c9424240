"""N-gram speculative decoding on a code-editing style load: acceptance (drafts kept / drafts
proposed), mean tokens a verifying step emits, steps and time, against the same requests
without speculation (greedy tokens compared), through the served loop's logic in one
process (EngineCore over an in-process Worker).

    python -m bench.speculative [--model DIR] [--requests 8] [--max-tokens 96] [--k 4]
        [--load code|pydoc]

`code`: each request gives a standard-library function's source, then asks for it again
after a comment (an edit repeats most of its input). `pydoc`: a paragraph of the built-in
model's training text, then its first sentence again (a model that knows the text
continues it as in the prompt).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import torch

from raygraph.config import (
    DEFAULT_MODEL,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from raygraph.engine.core import EngineCore, local_dispatch, run_to_completion
from raygraph.engine.ngram import NgramIndex
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams
from raygraph.tokenizer import load_tokenizer
from raygraph.worker.worker import Worker


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


def run(cfg: ServeConfig, worker: Worker, ids: list[list[int]], max_tokens: int, spec: bool,
        blocks: int) -> dict:
    core = EngineCore.from_config(cfg, worker.model_cfg, blocks)
    seqs = []
    for i, p in enumerate(ids):
        seq = Sequence(i, p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                            ignore_eos=True).resolved())
        if spec:
            s = cfg.speculative
            seq.ngram = NgramIndex(s.prompt_lookup_min, s.prompt_lookup_max)
            seq.ngram.extend(p)
        core.schedulers[0].add(seq)
        seqs.append(seq)
    t0 = time.perf_counter()
    steps = run_to_completion(core, local_dispatch(worker))
    sched = core.schedulers[0]
    return {"seconds": time.perf_counter() - t0, "steps": steps,
            "tokens": [s.output_token_ids for s in seqs],
            "drafts": sched.num_draft_tokens, "kept": sched.num_accepted_tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--load", choices=["code", "pydoc"], default="code")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a = p.parse_args()
    device = a.device if a.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    tok = load_tokenizer(a.model)
    room = ModelConfig.from_pretrained(a.model).max_position_embeddings - a.max_tokens - 16
    ids = [i for i in map(tok.encode, prompts(a.load)) if len(i) <= room][: a.requests]
    longest = max(len(i) for i in ids) + a.max_tokens + 16
    blocks = len(ids) * -(-longest // 16) + 8
    cfg = ServeConfig(model=a.model, device=device,
                      cache=CacheConfig(block_size=16, num_blocks=blocks),
                      scheduler=SchedulerConfig(max_num_seqs=max(8, len(ids) * (a.k + 1)),
                                                max_num_batched_tokens=2048,
                                                max_model_len=longest),
                      speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=a.k))
    worker = Worker(cfg, 0)
    worker.load(("127.0.0.1", 0))
    worker.allocate_kv_cache(blocks)
    worker.capture_all()
    plain = run(cfg, worker, ids, a.max_tokens, False, blocks)
    spec = run(cfg, worker, ids, a.max_tokens, True, blocks)
    print(json.dumps({
        "model": a.model, "device": device, "load": a.load, "requests": len(ids), "k": a.k,
        "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
        "acceptance": round(spec["kept"] / max(1, spec["drafts"]), 3),
        "drafts": spec["drafts"], "kept": spec["kept"],
        "steps_plain": plain["steps"], "steps_spec": spec["steps"],
        "seconds_plain": round(plain["seconds"], 2), "seconds_spec": round(spec["seconds"], 2),
        "tokens_equal": plain["tokens"] == spec["tokens"],
    }), flush=True)


if __name__ == "__main__":
    main()
