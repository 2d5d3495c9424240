"""Random-weight HF checkpoints of named shapes, for benchmarks (weights need not be trained
to time a step), or only their config.json for `--load-format dummy` (the workers draw the
weights on the device: shapes too large to write to disk can be timed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
    # Llama-3.1-8B's config.json (8.03 B params, 16.1 GB in bf16): the figure of merit's
    # model, served at its full 128K context (a block-table row of 8,192 blocks)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rms_norm_eps=1e-5,
                      bos_token_id=128000, eos_token_id=128001,
                      rope_parameters=dict(
                          rope_type="llama3", rope_theta=500000.0, factor=8.0,
                          low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    # Llama-3.1-70B's config.json (70.6 B params, 141 GB in bf16): for config-only dummy runs
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=131072, rms_norm_eps=1e-5,
                       bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
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


def hf_config(preset: str, **extra: object) -> tuple[str, Any]:
    """(architecture prefix, transformers config) of a preset."""
    import transformers

    kw = dict(PRESETS[preset])
    arch = kw.pop("arch", "Llama")
    cfg_cls = getattr(transformers, f"{arch}Config")
    return arch, cfg_cls(**{"max_position_embeddings": 4096, **kw, **extra},
                         architectures=[f"{arch}ForCausalLM"])


def make_random_checkpoint(out: str | Path, preset: str, dtype: str = "bfloat16") -> Path:
    import transformers

    out = Path(out)
    arch, cfg = hf_config(preset)
    if (out / "config.json").is_file():
        # fields that shape no weight (positions, eps, token ids) follow edits to PRESETS
        if _weight_shapes(json.loads((out / "config.json").read_text())) == \
                _weight_shapes(cfg.to_dict()):
            hf_config(preset, dtype=getattr(torch, dtype))[1].save_pretrained(out)
            return out
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def _weight_shapes(config: dict) -> tuple:
    """The config.json fields that shape a checkpoint's tensors."""
    return tuple(config.get(k) for k in (
        "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "tie_word_embeddings", "num_local_experts"))


def write_config(out: str | Path, preset: str, dtype: str = "bfloat16") -> Path:
    """A directory holding only the preset's config.json (as make_random_checkpoint's, no
    weights, no tokenizer): a model for `load_format = "dummy"`. Rewritten every call: it
    costs nothing and follows edits to PRESETS."""
    out = Path(out)
    _, cfg = hf_config(preset, dtype=getattr(torch, dtype))
    cfg.save_pretrained(out)
    return out


def write_eagle3_config(out: str | Path, preset: str, draft_vocab: int = 32000) -> Path:
    """The config.json of an EAGLE-3 head for `preset` (one layer of its width, the EAGLE
    authors' fields; Llama-3.1-8B's heads draft from 32,000 tokens), for dummy weights."""
    import json

    _, cfg = hf_config(preset)
    t = cfg.to_dict()
    head = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                              "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                              "vocab_size", "rope_parameters") if k in t}
    head.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                num_hidden_layers=1, draft_vocab_size=min(draft_vocab, t["vocab_size"]),
                torch_dtype="bfloat16")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head))
    return out


def bench_model(preset: str, load_format: str) -> str:
    """The benchmarks' directory for `preset`: a random checkpoint, or for dummy weights its
    config.json alone (a directory of its own: a config-only one is no checkpoint)."""
    if load_format == "dummy":
        return str(write_config(f"/tmp/raygraph-bench/{preset}-config", preset))
    return str(make_random_checkpoint(f"/tmp/raygraph-bench/{preset}", preset))


def add_weight_flags(p: argparse.ArgumentParser, note: str = "") -> None:
    """--load-format, --quantization and --kv-cache-dtype, as `raygraph serve` takes them;
    `note` ends each help text (what the flag changes in that benchmark)."""
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: the preset's config.json only, weights drawn on the device"
                        + note)
    p.add_argument("--quantization", choices=["auto", "fp8"], default="auto",
                   help="fp8: the linear layers quantized to FP8 e4m3 at load" + note)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="fp8: the KV cache in FP8 e4m3 (twice the tokens)" + note)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    p.add_argument("--config-only", action="store_true",
                   help="write config.json alone, for --load-format dummy")
    a = p.parse_args()
    print(write_config(a.out, a.preset) if a.config_only else
          make_random_checkpoint(a.out, a.preset))
