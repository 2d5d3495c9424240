"""How a checkpoint's linear layers are stored in FP8, read from its config.json (or ModelOpt's
hf_quant_config.json): one typed `QuantConfig` for the three published formats and for
quantizing a bf16/fp16/fp32 checkpoint at load. Any other method is refused in one line.

No torch here: the driver reads it before any worker starts (model/quant.py does the math).
"""

from __future__ import annotations

import json
import re
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

import msgspec

# the three published FP8 formats raygraph loads, as config.json's quant_method names them
FORMATS = "compressed-tensors float-quantized, fp8 (HF fine-grained), modelopt FP8"


class QuantError(ValueError):
    """A quantization_config raygraph cannot run, with the reason in the message."""


class QuantConfig(msgspec.Struct, frozen=True):
    """FP8 e4m3 weights of every decoder linear layer (q|k|v, o, gate|up, down) not ignored.

    weights: the stored scales: one per tensor (`*.weight_scale` []), per output channel
    ([out, 1]) or per `block` of [rows, cols] (`*.weight_scale_inv` of the fine-grained
    format). activations: "none" is weight-only; "dynamic" quantizes each token's activations
    (over each block's columns with block weights); "static" with the checkpoint's
    `*.input_scale`."""

    method: Literal["compressed-tensors", "fp8", "modelopt", "online"]
    weights: Literal["tensor", "channel", "block"]
    activations: Literal["none", "dynamic", "static"]
    block: tuple[int, int] | None = None  # [rows, cols] a block weight scale covers
    ignore: tuple[str, ...] = ()  # modules left unquantized (names, "re:" regexes, globs)
    kv_scales: bool = False  # the checkpoint has attention k_scale / v_scale (FP8 KV cache)

    @property
    def scale_name(self) -> str:
        """The checkpoint suffix of a weight's scale (what dequantizes it, multiplied in)."""
        return "weight_scale_inv" if self.method == "fp8" and self.block else "weight_scale"

    def ignores(self, module: str) -> bool:
        """Whether the HF module `module` (model.layers.0.self_attn.q_proj) stays unquantized:
        an entry "re:<regex>" matches the whole name (compressed-tensors), one with "*" is a
        glob (ModelOpt), any other the name or a run of its dotted parts (transformers)."""
        parts = module.split(".")
        for entry in self.ignore:
            if entry.startswith("re:"):
                hit = re.fullmatch(entry[3:], module) is not None
            elif "*" in entry:
                hit = fnmatchcase(module, entry)
            else:
                e = entry.split(".")
                hit = any(parts[i:i + len(e)] == e for i in range(len(parts) - len(e) + 1))
            if hit:
                return True
        return False


ONLINE = QuantConfig("online", "channel", "dynamic")


def read_quant_config(path: str, hf: dict[str, Any], cfg_file: Path) -> QuantConfig | None:
    """The checkpoint's FP8 layout (None: not quantized), or QuantError naming the method."""
    qc = hf.get("quantization_config")
    modelopt_file = Path(path) / "hf_quant_config.json"
    if qc is None and modelopt_file.is_file():
        try:
            qc = {"quant_method": "modelopt", **json.loads(modelopt_file.read_text())}
        except json.JSONDecodeError as e:
            raise QuantError(f"{modelopt_file} is not valid JSON: {e}") from None
        cfg_file = modelopt_file
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantError(f"quantization_config in {cfg_file} is not a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fine_grained,
               "modelopt": _modelopt}
    if method not in readers:
        raise QuantError(f"quantization method {method or 'unnamed'!r} in {cfg_file} is not "
                         f"supported; raygraph loads FP8 checkpoints ({FORMATS})")
    return readers[method](qc, cfg_file)


def _refuse(what: str, cfg_file: Path) -> QuantError:
    return QuantError(f"{what} in {cfg_file} is not supported; raygraph loads FP8 checkpoints "
                      f"({FORMATS})")


def _compressed_tensors(qc: dict[str, Any], cfg_file: Path) -> QuantConfig:
    """RedHatAI / Neural Magic checkpoints: config_groups of FP8 weights targeting Linear."""
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}", cfg_file)
    groups = list((qc.get("config_groups") or {}).values())
    if not groups or any(g != groups[0] for g in groups):
        raise _refuse("compressed-tensors without exactly one scheme in config_groups", cfg_file)
    group = groups[0]
    if "Linear" not in (group.get("targets") or ()):
        raise _refuse(f"compressed-tensors targets {group.get('targets')!r}", cfg_file)
    w = group.get("weights") or {}
    if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("dynamic"):
        raise _refuse(f"compressed-tensors weights of type {w.get('type')!r}, "
                      f"{w.get('num_bits')} bits", cfg_file)
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise _refuse(f"compressed-tensors weight strategy {strategy!r}", cfg_file)
    block = _block(w.get("block_structure"), cfg_file) if strategy == "block" else None
    a = group.get("input_activations")
    if a is None:
        activations = "none"
    elif (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise _refuse(f"compressed-tensors activations of type {a.get('type')!r}, "
                      f"{a.get('num_bits')} bits", cfg_file)
    elif a.get("dynamic"):
        if a.get("strategy") != ("group" if block else "token"):
            raise _refuse(f"compressed-tensors dynamic activations by {a.get('strategy')!r} "
                          f"with {strategy} weights", cfg_file)
        activations = "dynamic"
    elif a.get("strategy") == "tensor" and not block:
        activations = "static"
    else:
        raise _refuse(f"compressed-tensors static activations by {a.get('strategy')!r}",
                      cfg_file)
    return QuantConfig("compressed-tensors", strategy, activations, block,
                       tuple(qc.get("ignore") or ()), qc.get("kv_cache_scheme") is not None)


def _fine_grained(qc: dict[str, Any], cfg_file: Path) -> QuantConfig:
    """transformers' FP8 format: 128 x 128 blocks (Qwen3-*-FP8, DeepSeek) or, without
    weight_block_size, one scale per tensor (AutoFP8)."""
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fp8 fmt {qc.get('fmt')!r}", cfg_file)
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(f"fp8 activation_scheme {scheme!r}", cfg_file)
    raw = qc.get("weight_block_size")
    block = _block(raw, cfg_file) if raw is not None else None
    if block and scheme == "static":
        raise _refuse("fp8 block weights with static activations", cfg_file)
    return QuantConfig("fp8", "block" if block else "tensor", scheme, block,
                       tuple(qc.get("modules_to_not_convert") or ()))


def _modelopt(qc: dict[str, Any], cfg_file: Path) -> QuantConfig:
    """NVIDIA ModelOpt: per-tensor weight and static input scales (FP8), or per-channel
    weights with dynamic per-token activations (FP8_PER_CHANNEL_PER_TOKEN)."""
    q = qc.get("quantization", qc)
    algo = str(q.get("quant_algo"))
    schemes = {"FP8": ("tensor", "static"), "FP8_PER_CHANNEL_PER_TOKEN": ("channel", "dynamic")}
    if algo not in schemes:
        raise _refuse(f"modelopt quant_algo {algo!r}", cfg_file)
    kv = q.get("kv_cache_quant_algo")
    if kv not in (None, "FP8"):
        raise _refuse(f"modelopt kv_cache_quant_algo {kv!r}", cfg_file)
    ignore = q.get("exclude_modules") or q.get("ignore") or ()
    return QuantConfig("modelopt", *schemes[algo], ignore=tuple(ignore), kv_scales=kv == "FP8")


def _block(raw: object, cfg_file: Path) -> tuple[int, int]:
    if (not isinstance(raw, list | tuple) or len(raw) != 2
            or not all(isinstance(v, int) and v > 0 for v in raw)):
        raise _refuse(f"weight block size {raw!r}", cfg_file)
    return int(raw[0]), int(raw[1])
