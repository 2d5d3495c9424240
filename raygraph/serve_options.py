"""The serving options `raygraph serve` takes as flags and `raygraph.LLM` as keywords, applied
to a ServeConfig in one place so the two cannot drift: each flag's argparse `dest` is its
keyword here, and None means "not given" (the --config file's value, else the default)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from raygraph.config import ConfigError, ServeConfig, SpeculativeConfig, load_toml, parse_bytes
from raygraph.hub import resolve_model

DEFAULT_MAX_LORAS = 4  # slots when adapters are named but max_loras is not

# keyword -> (ServeConfig section, field) it sets as given; "" is ServeConfig itself
FIELDS: dict[str, tuple[str, str]] = {
    "device": ("", "device"),
    "tokenizer": ("", "tokenizer"),
    "dtype": ("", "dtype"),
    "load_format": ("", "load_format"),
    "quantization": ("", "quantization"),
    "tp": ("parallel", "tp"),
    "dp": ("parallel", "dp"),
    "ep": ("parallel", "ep"),
    "replicas": ("replica", "replicas"),
    "min_replicas": ("replica", "min_replicas"),
    "idle_sleep_s": ("replica", "idle_sleep_s"),
    "max_replicas": ("replica", "max_replicas"),
    "placement": ("replica", "placement"),
    "routing": ("replica", "routing"),
    "block_size": ("cache", "block_size"),
    "kv_cache_dtype": ("cache", "cache_dtype"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_model_len": ("scheduler", "max_model_len"),
    "graph_pool": ("graph", "pool"),
    "prefill_graph": ("graph", "prefill_graph"),
    "decode_cascade": ("graph", "decode_cascade"),
    "capture": ("graph", "capture"),
    "offload_mode": ("offload", "mode"),
    "max_loras": ("lora", "max_loras"),
    "max_lora_rank": ("lora", "max_lora_rank"),
    "max_lora_adapters": ("lora", "max_adapters"),
}

def speculative(value: Any) -> SpeculativeConfig:
    """--speculative-config's JSON object (vLLM's keys: method, model,
    num_speculative_tokens, prompt_lookup_min, prompt_lookup_max), or the same as a dict."""
    try:
        return msgspec.convert(json.loads(value) if isinstance(value, str) else value,
                               SpeculativeConfig)
    except (ValueError, msgspec.ValidationError) as e:
        raise ConfigError(f"speculative config: {e} (methods: ngram, draft, eagle3)") from None


# keyword -> (section, field, conversion) for values given in another unit or shape
CONVERTED: dict[str, tuple[str, str, Any]] = {
    "speculative_config": ("", "speculative", speculative),
    "eager": ("graph", "mode", lambda on: "eager" if on else "graph"),
    "offload_budget": ("offload", "budget_bytes",
                       lambda v: parse_bytes(v) if isinstance(v, str) else v),
    "lora_warm_budget": ("lora", "warm_budget_bytes", lambda gib: int(gib * 2**30)),
    # {name: path} or (name, path) pairs
    "lora_modules": ("lora", "modules", lambda v: tuple(
        (str(n), str(p)) for n, p in (v.items() if isinstance(v, Mapping) else v))),
    "lora_target_modules": ("lora", "target_modules", tuple),
    "lora_allowed_dirs": ("lora", "allowed_dirs", tuple),
}

# where the model comes from: a directory or hub id, and the TOML config underneath it all
SOURCE = ("model", "revision", "download_dir", "config")

SERVE_OPTIONS: tuple[str, ...] = SOURCE + tuple(FIELDS) + tuple(CONVERTED)


def build_config(options: Mapping[str, Any]) -> ServeConfig:
    """The ServeConfig of `options` (SERVE_OPTIONS; None values are not given) over the
    `config` TOML file's or the defaults. A hub id `model` is resolved (downloaded) here,
    before Ray starts. TypeError names an unknown option."""
    unknown = [k for k in options if k not in SERVE_OPTIONS]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; valid: "
                        f"{', '.join(SERVE_OPTIONS)}")
    given = {k: v for k, v in options.items() if v is not None}
    cfg = load_toml(given["config"]) if "config" in given else ServeConfig()
    updates: dict[str, dict[str, Any]] = {}
    for key, value in given.items():
        if key in FIELDS:
            section, field = FIELDS[key]
        elif key in CONVERTED:
            section, field, convert = CONVERTED[key]
            value = convert(value)
        else:
            continue
        updates.setdefault(section, {})[field] = value
    lora = updates.setdefault("lora", {})
    if lora.get("modules", cfg.lora.modules) and not lora.get("max_loras", cfg.lora.max_loras):
        lora["max_loras"] = DEFAULT_MAX_LORAS
    top = updates.pop("", {})
    sections = {name: msgspec.structs.replace(getattr(cfg, name), **fields)
                for name, fields in updates.items()}
    dummy = top.get("load_format", cfg.load_format) == "dummy"  # no weights to download
    model = resolve_model(given.get("model", cfg.model), given.get("revision"),
                          given.get("download_dir"), weights=not dummy)
    if top.get("tokenizer"):  # its files only
        top["tokenizer"] = resolve_model(top["tokenizer"], download_dir=given.get("download_dir"),
                                         weights=False)
    return msgspec.structs.replace(cfg, model=model, **top, **sections)
