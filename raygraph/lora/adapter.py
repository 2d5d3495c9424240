"""PEFT LoRA adapters on disk (adapter_config.json + adapter_model.safetensors), read and
checked against the base model's shapes: a bad adapter is one LoRAError naming the path.
The directory's files and config are read by raygraph/adapter_files.py, which config uses
too."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from raygraph.adapter_files import LORA_MODULES, TENSOR, WEIGHTS_FILE, Fail, failer, read_config
from raygraph.config import ModelConfig

SUPPORTED_MODULES = LORA_MODULES
# adapter_config.json fields whose truthy values change the math raygraph computes
UNSUPPORTED = ("use_dora", "modules_to_save", "lora_bias", "fan_in_fan_out", "rank_pattern",
               "alpha_pattern", "layer_replication", "target_parameters", "use_qalora",
               "trainable_token_indices", "alora_invocation_tokens")
MODULE = re.compile(r"(\w+)\.lora_(?:embedding_)?[AB]")


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: delta(x) = scaling * (x A^T) B^T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    path: str
    rank: int
    layers: dict[int, dict[str, LoRAModule]]  # layer -> HF module name (q_proj, ...) -> weights

    @property
    def modules(self) -> set[str]:
        return {name for mods in self.layers.values() for name in mods}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each supported projection's (in, out) features in the full (unsharded) model."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int,
                 targets: tuple[str, ...] = SUPPORTED_MODULES) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter directory against the base model `cfg` and the
    modules served (`targets`: LoRAConfig.targets)."""
    root = Path(path)
    fail = failer(root)
    conf = read_config(root, fail)
    rank, scaling = _check_config(conf, fail, max_rank)
    tensors = _read_tensors(root / WEIGHTS_FILE, fail)
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = TENSOR.search(name)
        if m is None:
            module = MODULE.search(name)
            what = f"module {module.group(1)!r}" if module else f"tensor {name!r}"
            raise fail(f"unsupported target {what}; supported: {list(SUPPORTED_MODULES)}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in shapes:
            raise fail(f"unsupported target module {module!r}; supported: "
                       f"{list(SUPPORTED_MODULES)}")
        if layer >= cfg.num_layers:
            raise fail(f"layer {layer} of {name!r} is out of range (the model has "
                       f"{cfg.num_layers} layers)")
        in_f, out_f = shapes[module]
        want = (rank, in_f) if ab == "A" else (out_f, rank)
        if tuple(t.shape) != want:
            raise fail(f"{name} has shape {tuple(t.shape)}; rank {rank} on the base model's "
                       f"{module} ({in_f} -> {out_f}) needs {want}")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    layers: dict[int, dict[str, LoRAModule]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if len(ab) != 2:
            raise fail(f"layer {layer} {module} has lora_{next(iter(ab))} without "
                       f"lora_{'B' if 'A' in ab else 'A'}")
        layers.setdefault(layer, {})[module] = LoRAModule(ab["A"], ab["B"], scaling)
    adapter = LoRAAdapter(str(root), rank, layers)
    outside = [m for m in SUPPORTED_MODULES if m in adapter.modules and m not in targets]
    if outside:
        raise fail(f"targets {outside[0]!r}, which has no adapter slots (served target "
                   f"modules: {list(targets)}; set them at start with --lora-target-modules)")
    return adapter


def _check_config(conf: dict, fail: Fail, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json; features raygraph does not compute refused."""
    if conf.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {conf.get('peft_type')!r} is not LORA")
    for field in UNSUPPORTED:
        if conf.get(field):
            raise fail(f"{field}={conf[field]!r} is not supported")
    if conf.get("bias", "none") != "none":
        raise fail(f"bias={conf['bias']!r} is not supported (only 'none')")
    targets = conf.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(SUPPORTED_MODULES))
        if bad:
            raise fail(f"unsupported target modules {bad}; supported: {list(SUPPORTED_MODULES)}")
    rank, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise fail(f"r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise fail(f"rank {rank} is over max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise fail(f"lora_alpha={alpha!r} is not a number")
    return rank, alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)


def _read_tensors(file: Path, fail: Fail) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as e:
        raise fail(f"cannot read {file.name}: {e}") from None
