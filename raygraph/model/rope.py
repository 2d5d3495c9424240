"""Rotary frequencies for the RoPE variants HF checkpoints use, computed as transformers
computes them (modeling_rope_utils), so tables and tokens match it.

Each variant gives inverse frequencies [head_dim / 2] and an attention factor that scales
cos and sin (YaRN's; 1 elsewhere). The tables are precomputed once per model: every step,
eager or captured, reads the same ones.
"""

from __future__ import annotations

import math

import torch

from raygraph.config import ROPE_TYPES, ConfigError, ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _need(params: dict, *keys: str) -> list:
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ConfigError(f"rope type {params['rope_type']!r} needs {missing} in its parameters")
    return [params[k] for k in keys]


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor, low, high, old_len = _need(params, "factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, params: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    (original,) = _need(params, "original_max_position_embeddings")
    factor = params.get("factor") or max_pos / original
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                     if mscale and mscale_all else get_mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp  # the share of each frequency left unscaled (extrapolated)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(attention)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], cos/sin scale) for the model's RoPE variant.

    `dynamic` (NTK) rescales only past max_position_embeddings, per batch in transformers;
    raygraph's context never goes past it (ServeConfig.max_model_len), where transformers
    computes the default frequencies, so those are the ones used.
    """
    params = dict(cfg.rope_scaling)
    kind = params.get("rope_type", "default")
    theta, dim = cfg.rope_theta, cfg.head_dim
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    inv_freq = _base_inv_freq(theta, dim)
    if kind == "linear":
        (factor,) = _need(params, "factor")
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, params, cfg.max_position_embeddings)
    return inv_freq, 1.0


def rope_tables(cfg: ModelConfig, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_pos, head_dim / 2] in fp32."""
    inv_freq, scale = rope_frequencies(cfg)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale
