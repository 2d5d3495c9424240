"""Reference greedy decoding with HF transformers (full recompute each step: no cache API),
optionally with a PEFT adapter."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              adapter: Path | None = None, attention: str | None = None) -> list[list[int]]:
    """`adapter`: a PEFT LoRA adapter directory applied on top (peft, unmerged);
    `attention`: an attention implementation registered with transformers'
    AttentionInterface (None: its default)."""
    import transformers

    kw = {"attn_implementation": attention} if attention else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              **kw)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(max_tokens):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(ids[0, len(prompt):].tolist())
    return out
