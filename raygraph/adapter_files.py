"""A PEFT LoRA adapter directory on disk (adapter_config.json + adapter_model.safetensors):
its files checked, its config read and the modules it targets. No torch and nothing of
raygraph but its errors, so LoRAConfig can infer its target modules here; lora/adapter.py
reads the weights."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

from raygraph.errors import LoRAError

# the HF projections a LoRA adapter may target
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight (PEFT prefixes it with base_model.)
TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


Fail = Callable[[str], LoRAError]  # reason -> the error naming the adapter


def failer(root: Path) -> Fail:
    return lambda reason: LoRAError(f"LoRA adapter {str(root)!r}: {reason}")


def read_config(root: Path, fail: Fail) -> dict:
    """adapter_config.json as a dict, once the directory and both files are there."""
    if not root.is_dir():
        raise fail("not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / name).is_file():
            hint = " (adapter_model.bin is not read: save with safetensors)" if (
                name == WEIGHTS_FILE and (root / "adapter_model.bin").is_file()) else ""
            raise fail(f"missing {name}{hint}")
    try:
        conf = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise fail(f"cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(conf, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    return conf


def adapter_targets(path: str | Path) -> set[str]:
    """The modules the adapter at `path` targets, as its adapter_config.json lists them
    (a regex there, not a list: the modules its weights name)."""
    root = Path(path)
    fail = failer(root)
    targets = read_config(root, fail).get("target_modules")
    if isinstance(targets, list):
        names = set(targets)
    else:
        try:
            with safe_open(str(root / WEIGHTS_FILE), framework="pt") as f:
                names = {m.group(2) for k in f.keys() if (m := TENSOR.search(k))}
        except (OSError, SafetensorError) as e:
            raise fail(f"cannot read {WEIGHTS_FILE}: {e}") from None
    bad = sorted(names - set(LORA_MODULES))
    if bad:
        raise fail(f"unsupported target modules {bad}; supported: {list(LORA_MODULES)}")
    return names
