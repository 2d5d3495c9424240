"""The forms an op's result rows take for the FP8 GEMM after it (the op is told that GEMM's
layout, `feeds`), so the GEMM skips a conversion of its own:

- past the decode rows, where the GEMM quantizes x per token for the FP8 tensor cores, the
  op also stores its rows in e4m3 with their scales (QUANTIZED);
- at 2 to DECODE_ROWS rows, where the skinny kernels multiply x in float16, the op stores
  its bfloat16 rows in float16 (STANDS_FOR): the norms for q|k|v and gate|up, attention for
  o, gate|up for down. Anything other than those kernels converts them back (`restored`).

Markers are attributes on the result tensor: a view of it does not carry them.
"""

from __future__ import annotations

import torch

from raygraph.model.quant import DECODE_ROWS, Fp8Layout, fp8_columns_ok

# (e4m3 rows [T, K], float32 scales [T, 1]): activations quantized per token
Quantized = tuple[torch.Tensor, torch.Tensor]

# FP8 GEMMs of more than DECODE_ROWS rows go to the W8A8 tensor-core GEMMs on a GPU; fewer
# (decode) stream the FP8 weight through the skinny kernels
SCALED_MM_MIN_ROWS = DECODE_ROWS + 1

# the attribute an activation tensor carries when the op that made it also stored it in
# e4m3 per token (rms_norm, add_rms_norm, silu_and_mul with `feeds`): its (e4m3 rows, scales)
QUANTIZED = "raygraph_fp8_rows"

# the attribute of float16 rows standing for rows of another dtype (the activations'
# bfloat16): its values clamped to float16's range (exact within its normal range); the
# skinny kernels take them as they are and compute in the dtype they stand for
STANDS_FOR = "raygraph_float16_for"


def quantizes_for(x: torch.Tensor, feeds: Fp8Layout | None, k: int | None = None) -> bool:
    """Whether the op making [T, k] from x [T, *] (k: x's width unless given) also stores
    it in e4m3 per token: the result feeds an FP8 GEMM (`feeds`: its layout, read off the
    layer, not its weight, which an offloaded model fetches only in its turn) that
    quantizes it so: dynamic activations, one weight scale a row, past the decode rows
    (ops.fp8_gemm), which then skips its own quantization launch."""
    k = x.shape[-1] if k is None else k
    return (feeds is not None and feeds.activations == "dynamic" and x.is_cuda
            and x.dim() == 2 and x.shape[0] >= SCALED_MM_MIN_ROWS
            and x.dtype == torch.bfloat16 and feeds.group == k and k % 16 == 0)


def with_quantized(x: torch.Tensor, quantized: Quantized | None) -> torch.Tensor:
    """x, carrying its e4m3 rows and scales where the op stored them."""
    if quantized is not None:
        setattr(x, QUANTIZED, quantized)
    return x


def act_dtype(x: torch.Tensor) -> torch.dtype:
    """The activation dtype x's rows hold: the one they stand for, else x's."""
    return getattr(x, STANDS_FOR, x.dtype)


def restored(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype its rows stand for (x itself if they stand for none)."""
    act = getattr(x, STANDS_FOR, None)
    return x if act is None else x.to(act)


def halves_for(rows: int, act: torch.dtype, feeds: Fp8Layout | None, k: int) -> bool:
    """Whether an op making [rows, k] of activation dtype `act` stores them in float16
    (STANDS_FOR): they feed an FP8 GEMM (`feeds`) the skinny kernels take, at 2 to
    DECODE_ROWS bfloat16 rows, which they multiply in float16 (bench/RESULTS.md, "float16
    rows for the down projection" and "float16 rows from the norms and attention")."""
    return (feeds is not None and act == torch.bfloat16 and 1 < rows <= DECODE_ROWS
            and fp8_columns_ok(k, feeds.group))


def marked(x: torch.Tensor, half: bool) -> torch.Tensor:
    """x, marked as float16 rows standing for bfloat16 ones where `half` made them so."""
    if half:
        setattr(x, STANDS_FOR, torch.bfloat16)
    return x
