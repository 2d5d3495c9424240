"""Tiny FP8 checkpoints in the three published layouts, made from a float checkpoint, each with
its reference: the same model as a float checkpoint holding the dequantized weights.

The quantization here is written out independently of raygraph/model/quant.py (same tensor
names, dtypes and config fields as the published checkpoints), so a wrong loader or kernel
cannot agree with it by sharing a bug.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Fp8Format:
    """A published layout: config (compressed-tensors, fp8, modelopt), weight scales (tensor,
    channel, block) and activations (none, dynamic, static)."""

    method: str
    weights: str
    activations: str
    block: tuple[int, int] | None = None
    modelopt_file: bool = False  # ModelOpt's hf_quant_config.json instead of config.json's
    not_convert: tuple[str, ...] = ()  # fine-grained modules_to_not_convert

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" and self.block else "weight_scale"

    @property
    def scale_dtype(self) -> torch.dtype:
        # compressed-tensors saves its scales in the model's dtype; the others in float32
        return torch.bfloat16 if self.method == "compressed-tensors" else torch.float32


def quantization_config(fmt: Fp8Format) -> dict:
    """config.json's quantization_config as the published checkpoints write it."""
    if fmt.method == "compressed-tensors":
        def scheme(strategy: str, dynamic: bool, **kw: object) -> dict:
            return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                    "dynamic": dynamic, "group_size": None, "block_structure": None,
                    "actorder": None, "observer": None if dynamic else "minmax",
                    "observer_kwargs": {}, **kw}
        acts = {"none": None, "dynamic": scheme("token", True),
                "static": scheme("tensor", False)}[fmt.activations]
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "kv_cache_scheme": None, "global_compression_ratio": 1.5,
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "output_activations": None,
                    "weights": scheme(fmt.weights, False), "input_activations": acts}}}
    if fmt.method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": fmt.activations}
        if fmt.block:
            qc["weight_block_size"] = list(fmt.block)
        if fmt.not_convert:
            qc["modules_to_not_convert"] = list(fmt.not_convert)
        return qc
    return {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head"]}


def quantize(w: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale as stored) of a float weight [out, in]."""
    w = w.float()
    out, cols = w.shape
    if fmt.weights == "tensor":
        scale = w.abs().max() / 448
        stored = scale.reshape(1) if fmt.method == "compressed-tensors" else scale.reshape(())
        per_elem = scale.expand(out, cols)
    elif fmt.weights == "channel":
        stored = w.abs().amax(dim=1, keepdim=True) / 448
        per_elem = stored.expand(out, cols)
    else:
        b0, b1 = fmt.block
        stored = torch.empty(math.ceil(out / b0), math.ceil(cols / b1))
        for i in range(stored.shape[0]):
            for j in range(stored.shape[1]):
                stored[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448
        per_elem = stored.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :cols]
    q = (w / per_elem).clamp(-448, 448).to(FP8)
    return q, stored.to(fmt.scale_dtype)


def dequantize(q: torch.Tensor, stored: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float32 weight of an FP8 one and its stored scale, element by element."""
    out, cols = q.shape
    s = stored.float()
    if fmt.weights == "tensor":
        per_elem = s.reshape(1, 1).expand(out, cols)
    elif fmt.weights == "channel":
        per_elem = s.expand(out, cols)
    else:
        b0, b1 = fmt.block
        per_elem = s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :cols]
    return q.float() * per_elem


def input_amax(src: Path, prompt: list[int]) -> dict[str, float]:
    """Each projection's largest input magnitude over one prompt (the calibration that gives
    static input scales), by HF transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def hook(name: str):
        def record(_module: torch.nn.Module, args: tuple) -> None:
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
        return record

    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(torch.tensor([prompt]))
    return amax


def write_fp8(src: Path, dst: Path, ref: Path, fmt: Fp8Format) -> None:
    """`dst`: `src` (a float32 HF checkpoint) quantized in `fmt`; `ref`: `src` with every
    quantized weight replaced by its dequantized values (the rest as in `dst`)."""
    tensors = load_file(src / "model.safetensors")
    amax = input_amax(src, list(range(3, 60))) if fmt.activations == "static" else {}
    quant: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.endswith(PROJECTIONS)) or any(
                f".{m}." in f".{module}." for m in fmt.not_convert):
            quant[name] = deq[name] = t.to(torch.bfloat16)
            continue
        q, stored = quantize(t, fmt)
        quant[name], quant[f"{module}.{fmt.scale_name}"] = q, stored
        deq[name] = dequantize(q, stored, fmt)
        if fmt.activations == "static":
            bump = 1.25 if module.endswith("k_proj") else 1.0  # fused parts may differ
            quant[f"{module}.input_scale"] = torch.tensor(bump * amax[module] / 448)
        if fmt.method == "modelopt" and module.endswith(("k_proj", "v_proj")):
            kv = module[-6]  # k or v
            quant[f"{module}.{kv}_scale"] = torch.tensor(0.5 if kv == "k" else 0.25)
    for path, weights in ((dst, quant), (ref, deq)):
        path.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, path / f.name)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if fmt.modelopt_file:
        producer = {"name": "modelopt", "version": "0.29.0"}
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": producer, "quantization": quantization_config(fmt)}))
    else:
        cfg["quantization_config"] = quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


FORMATS = {
    "ct-channel-w8a16": Fp8Format("compressed-tensors", "channel", "none"),
    "ct-tensor-w8a16": Fp8Format("compressed-tensors", "tensor", "none"),
    "ct-channel-dynamic": Fp8Format("compressed-tensors", "channel", "dynamic"),
    "ct-tensor-static": Fp8Format("compressed-tensors", "tensor", "static"),
    # blocks that do not tile the tiny shapes (k_proj: 32 x 64): partial blocks at the edges
    "fp8-block": Fp8Format("fp8", "block", "dynamic", block=(24, 48)),
    "fp8-block-tp": Fp8Format("fp8", "block", "dynamic", block=(16, 32)),
    "modelopt": Fp8Format("modelopt", "tensor", "static"),
    "modelopt-file": Fp8Format("modelopt", "tensor", "static", modelopt_file=True),
}
