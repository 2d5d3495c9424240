"""FP8 e4m3 linear layers: the one representation model code sees (`Fp8Weight`, taken by
ops.linear and its fused variants), the math that quantizes and dequantizes it, and how a
checkpoint's scales (per tensor, per channel, per block) become it.

Every format is held the same way: FP8 data [out, in] and float32 scales [out, groups], one
per output row and `group` input columns (groups = 1: per channel). A per-tensor scale is
repeated over its tensor's rows, a block scale over its block's rows: the same values, and
q|k|v or gate|up parts with different scales stack into one GEMM by rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from raygraph.config import ConfigError
from raygraph.quantization import QuantConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INV_FP8_MAX = 1.0 / FP8_MAX
# the smallest scale: an all-zero row or token quantizes to zeros, not to NaN
MIN_SCALE = 1e-12
# e4m3 conversions and FP8 tensor cores: Ada, Hopper and later
FP8_CAPABILITY = (8, 9)
# GEMMs of this many rows or fewer (decode) multiply x as it is, whatever the weight's
# activation scheme: such a GEMM streams its weight, so rounding x to e4m3 first saves no
# time (it costs a pass over x) and loses accuracy. Larger ones run on FP8 tensor cores.
# At 16 rows the skinny kernels still beat quantizing x and torch._scaled_mm on the 8B
# shapes; at 32 they do not (bench/RESULTS.md, FP8 weights)
DECODE_ROWS = 16
Activations = Literal["none", "dynamic", "static"]


@dataclass(frozen=True)
class Fp8Weight:
    """W[o, i] = data[o, i] * scale[o, i // group]. activations: "none" multiplies x as it
    is (weight-only); "dynamic" quantizes x per token (per token and group of columns when
    group < in); "static" with one scale for every token (`input_scale`). Either only past
    DECODE_ROWS rows."""

    data: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out, ceil(in / group)] float32
    group: int
    activations: Activations
    input_scale: torch.Tensor | None = None  # [1] float32, for "static"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype`: [out, in]."""
        return dequantize(self.data, self.scale, self.group).to(dtype)


def check_fp8_device(device: torch.device, weights: bool, cache: bool) -> None:
    """FP8 weights or an FP8 KV cache on a GPU older than Ada: one clear error when the worker
    loads, not a kernel compile failure at the first step. A CPU runs the reference path."""
    if device.type != "cuda" or not (weights or cache):
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_CAPABILITY:
        what = " and ".join(n for n, on in (
            ("FP8 weights (--quantization fp8 or an FP8 checkpoint)", weights),
            ("an FP8 KV cache (--kv-cache-dtype fp8)", cache)) if on)
        raise ConfigError(f"{what} on {device}: compute capability {major}.{minor}; FP8 needs "
                          "8.9 or later (Ada, Hopper)")


def _per_column(scale: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    """Scales [rows, groups] spread to one a column, [rows, cols] (one a row, or [1]: as is,
    for broadcasting)."""
    if scale.dim() == 2 and scale.shape[1] > 1:
        return scale.repeat_interleave(group, dim=1)[:, :cols]
    return scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 data[r, c] * scale[r, c // group] of FP8 `data` [rows, cols]."""
    return data.to(torch.float32) * _per_column(scale, group, data.shape[-1])


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, float32 scales [rows, ceil(cols / group)]) of x [rows, cols]: each row's
    groups of `group` columns scaled so that their largest magnitude is FP8's 448."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = x.float()
    if groups * group != cols:
        padded = torch.nn.functional.pad(padded, (0, groups * group - cols))
    amax = padded.view(rows, groups, group).abs().amax(dim=-1)
    # times the float32 reciprocal, not divided: the same float32 on every device and kernel
    scale = (amax * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return quantize_with(x, scale, group), scale


def quantize_with(x: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, cols] / scale ([rows, groups], or [1] for one scale), clamped to FP8's range."""
    scale = _per_column(scale, group, x.shape[1])
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def rounds_activations(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether the GEMM of x [T, in] and w rounds x to e4m3 (see DECODE_ROWS)."""
    return w.activations != "none" and x.shape[0] > DECODE_ROWS


def activations_as_quantized(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [T, in] as the FP8 GEMM sees it, in x's dtype: quantized to FP8 and back by w's
    activation scheme (unchanged when weight-only or at decode rows). The reference path
    multiplies these by the dequantized weight: exactly the products an FP8 GEMM forms,
    summed in x's dtype."""
    if not rounds_activations(x, w):
        return x
    if w.activations == "static":
        assert w.input_scale is not None
        return (quantize_with(x, w.input_scale, 1).float() * w.input_scale).to(x.dtype)
    group = min(w.group, x.shape[1])
    q, scale = quantize(x, group)
    return dequantize(q, scale, group).to(x.dtype)


@dataclass(frozen=True)
class Fp8Layout:
    """How a linear layer's FP8 weight reads: input columns per scale column, activations."""

    group: int
    activations: Activations


def fp8_weight(layer: nn.Module) -> Fp8Weight:
    """The Fp8Weight of a layer `make_fp8` or `quantize_layer` converted."""
    layout: Fp8Layout = layer.fp8
    return Fp8Weight(layer.weight, layer.weight_scale, layout.group, layout.activations,
                     getattr(layer, "input_scale", None))


def local_group(quant: QuantConfig, in_full: int, in_local: int) -> int:
    """Input columns per scale column on a rank holding `in_local` of the `in_full` columns
    (the same for column-parallel layers). A block must not straddle two ranks."""
    if quant.block is None:
        return in_local  # one scale per output row
    cols = quant.block[1]
    if in_local != in_full and in_local % cols:
        raise ConfigError(f"FP8 blocks of {cols} input columns do not split over ranks holding "
                         f"{in_local} of {in_full} columns: use a smaller TP size")
    return cols


def make_fp8(layer: nn.Module, group: int, activations: Activations,
             device: torch.device) -> None:
    """Replace the layer's weight (on `device`, or meta: shapes only) by an FP8 one of its
    shape on `device`, with its scales (and a static input scale), for a checkpoint to fill.
    The input scale starts at 0: fused parts each raise it to their own (the GEMM quantizes
    x once, by the largest, clipping none)."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8, device=device),
                                requires_grad=False)
    groups = -(-w.shape[1] // group)
    layer.weight_scale = nn.Parameter(
        torch.empty(w.shape[0], groups, dtype=torch.float32, device=device),
        requires_grad=False)
    if activations == "static":
        layer.input_scale = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)
    layer.fp8 = Fp8Layout(group, activations)


def quantize_layer(layer: nn.Module) -> None:
    """Quantize a loaded layer's weight in place: one scale per output row (amax / 448),
    activations quantized per token."""
    data, scale = quantize(layer.weight.data, layer.weight.shape[1])
    layer.weight = nn.Parameter(data, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    layer.fp8 = Fp8Layout(data.shape[1], "dynamic")


def add_kv_scales(attention: nn.Module, device: torch.device) -> None:
    """The checkpoint's attention k_scale and v_scale (its FP8 KV cache's per-tensor
    scales), loaded into these parameters."""
    for name in ("k_scale", "v_scale"):
        setattr(attention, name, nn.Parameter(torch.ones(1, device=device), requires_grad=False))


def stored_scale_shape(quant: QuantConfig, weight: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a checkpoint stores the weight scale of a weight of full shape `weight` in."""
    out, cols = weight
    if quant.weights == "tensor":
        return (1,)  # a scalar [] too
    if quant.weights == "channel":
        return (out, 1)
    assert quant.block is not None
    return (-(-out // quant.block[0]), -(-cols // quant.block[1]))


def scale_rows(stored: torch.Tensor, quant: QuantConfig, weight: tuple[int, ...]
               ) -> torch.Tensor:
    """A checkpoint's weight scale as float32 rows [out, groups] for a weight of full shape
    `weight`: a tensor's scale repeated over its rows, a block's over the block's rows."""
    out = weight[0]
    stored = stored.float()
    if quant.weights == "tensor":
        return stored.reshape(1, 1).expand(out, 1)
    if quant.weights == "channel":
        return stored.reshape(out, 1)
    assert quant.block is not None
    return stored.repeat_interleave(quant.block[0], dim=0)[:out]


def fp8_columns_ok(k: int, group: int) -> bool:
    """An FP8 weight's K and input columns per scale that the kernels take: K a multiple of
    128, one scale a row (group K) or a power-of-two group of 16+ columns dividing K."""
    return k % 128 == 0 and (group == k or group >= 16 and group & (group - 1) == 0
                             and k % group == 0)
