"""Random-weight HF checkpoints of named shapes, for benchmarks (weights need not be trained
to time a step)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PRESETS = {
    # the ~1B Llama config the graph and memory benchmarks use: 1.10 B params, 2.21 GB in bf16
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "llama-tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
    # a ~0.9B Mixtral-style MoE for the DP x EP benchmarks: 8 experts, top-2
    "mixtral-1b": dict(arch="Mixtral", hidden_size=1024, intermediate_size=2048,
                       num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                       vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
    # Llama-3.2-1B's shape: llama3 rope, 128k vocabulary, tied embeddings (1.24 B params)
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      tie_word_embeddings=True, max_position_embeddings=16384,
                      rope_parameters=dict(
                          rope_type="llama3", rope_theta=500000.0, factor=32.0,
                          low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    # Llama-3.1-8B's shape (8.03 B params, 16.1 GB in bf16): the figure of merit's model
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192,
                      rope_parameters=dict(
                          rope_type="llama3", rope_theta=500000.0, factor=8.0,
                          low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    # Qwen2.5-7B's shape (7.6 B params: q/k/v biases, 152064 vocabulary, untied)
    "qwen2.5-7b": dict(arch="Qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, max_position_embeddings=32768,
                       rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # Qwen3-8B's shape (8.2 B params: per-head q/k norms, head_dim 128, untied)
    "qwen3-8b": dict(arch="Qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # a Qwen3-style ~1B (Qwen3-1.7B's widths, 16 of its 28 layers): q/k norms, head_dim 128
    # with 16 heads on a 2048 hidden size, 151936 vocabulary, tied embeddings (1.1 B params)
    "qwen3-1b": dict(arch="Qwen3", hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}


def make_random_checkpoint(out: str | Path, preset: str, dtype: str = "bfloat16") -> Path:
    import transformers

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    kw = dict(PRESETS[preset])
    arch = kw.pop("arch", "Llama")
    cfg = getattr(transformers, f"{arch}Config")(**{"max_position_embeddings": 4096, **kw})
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    a = p.parse_args()
    print(make_random_checkpoint(a.out, a.preset))
