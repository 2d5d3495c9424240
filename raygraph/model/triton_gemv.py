"""Skinny GEMMs for decode (M <= 8 tokens; FP8 weights: M <= quant.DECODE_ROWS), GPU only;
imported lazily by model/ops.py.

At decode a linear layer reads its whole weight to produce a few rows: the step is a weight
stream, so what matters is keeping HBM busy and launching few kernels. Each program owns a
few output columns and streams their weight rows over K (tensor-core dot with the tokens
padded to 16 rows, weight tiles pipelined through shared memory). Two epilogues fuse the op
that follows the GEMM, so its intermediate never round-trips through memory and its launch
disappears:
- `silu_mul`: W = [gate | up]; a program reads gate row n and up row n + I, writes
  silu(gate) * up (SwiGLU);
- `rotary`: W = [q | k | v] heads; a program's columns are whole rotation pairs (dims d and
  d + D/2 of one head), written rotated (neox) for q and k heads, as they are for v heads.
Rounding follows the unfused ops: the GEMM result is cast to the activation dtype before
the epilogue arithmetic, as torch would have stored it.

One token (M = 1, batch-1 decode) takes the row kernel (triton_gemv_row.py), with the
same epilogues.

FP8 weights (`Fp8Weight`) stream as their e4m3 bytes: the kernels widen each tile in
registers and apply the float32 scales, one a row (at the end) or one a row and GROUP input
columns (per tile), so a step reads half a bf16 weight's bytes plus the scales. x is
multiplied as it is (`quant.DECODE_ROWS`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from raygraph.model.quant import DECODE_ROWS, FP8, Fp8Weight, fp8_columns_ok
from raygraph.model.triton_gemv_row import (
    PLAIN,
    ROTARY,
    SILU_MUL,
    GemvConfig,
    pair_base,
    row_config,
    row_kernel,
    silu_mul,
)
from raygraph.model.triton_ops import TL_DTYPES, rows_out, to_float16
from raygraph.model.triton_pdl import pdl

# a linear layer's weight: [N, K] in the activations' dtype, or FP8 with its scales
Weight = torch.Tensor | Fp8Weight

MAX_M = 8  # tokens of a plain weight; above this cuBLAS is the better tool
MAX_M_FP8 = DECODE_ROWS  # of an FP8 weight; above this per-token FP8 and _scaled_mm
BM = 16  # tl.dot needs 16 rows: the tokens are padded (masked loads, masked stores)

X_AS_IS, X_HALF_IN_DOT, X_HALF_ONCE = 0, 1, 2  # how the tensor-core kernel's dot takes x



@triton.jit
def _dot_operand(x, F16: tl.constexpr):
    """x as the tensor-core dot takes it: as loaded (F16 = X_AS_IS), or in float16
    (`to_float16`) converted once as loaded (X_HALF_ONCE) or where the dot takes it
    (X_HALF_IN_DOT: every warp converts the whole tile)."""
    if F16 != 0 and x.dtype != tl.float16:
        x = to_float16(x, F16 == 2)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
    M, stride_xm, stride_wn, stride_ws, stride_om, stride_c,
    N: tl.constexpr, K: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    F16: tl.constexpr, ACT: tl.constexpr,
):
    """FP8: w is e4m3 with float32 scales ws [N, K / GROUP] (GROUP = K: one a row); a grouped
    weight's tiles are one group wide (BK = GROUP), each tile's product scaled as it is
    added. F16: the dot runs in float16 (`_dot_operand`; e4m3 is exact there): e4m3 widens
    to float16 in one conversion a pair of values, to bfloat16 in three. ACT: the dtype the
    result is computed in, as torch would store it (x's, or the one float16 x stands for);
    a float16 out of another ACT stores it clamped to float16's range (`rows_out`)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    if EPILOGUE == 2:
        # columns [0, BN/2) are dims j.. of a head's first half, [BN/2, BN) their rotation
        # partners j + D/2..: each program holds whole rotation pairs
        hb: tl.constexpr = BN // 2
        half: tl.constexpr = HEAD_DIM // 2
        rows = pair_base(pid, hb, HEAD_DIM) + cols % hb + (cols // hb) * half
    else:
        rows = pid * BN + cols
    nmask = rows < N
    rm = tl.arange(0, BM)
    mmask = rm < M
    rk = tl.arange(0, BK)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_rows = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    s_rows = ws_ptr + rows.to(tl.int64) * stride_ws
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        x = _dot_operand(tl.load(x_rows + k0, mask=mmask[:, None], other=0.0), F16)
        w = tl.load(w_rows + k0, mask=nmask[:, None], other=0.0)
        if FP8 and GROUP < K:
            s = tl.load(s_rows + k0 // GROUP, mask=nmask, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        if EPILOGUE == 1:  # up row n + N next to gate row n
            w_up = tl.load(w_rows + N * stride_wn + k0).to(x.dtype)
            if FP8 and GROUP < K:
                s_up = tl.load(s_rows + N * stride_ws + k0 // GROUP)
                acc_up += tl.dot(x, tl.trans(w_up), input_precision=PRECISION) * s_up[None, :]
            else:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PRECISION)
    if FP8 and GROUP == K:
        acc *= tl.load(s_rows, mask=nmask, other=0.0)[None, :]
        if EPILOGUE == 1:
            acc_up *= tl.load(s_rows + N * stride_ws)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=nmask, other=0.0).to(tl.float32)[None, :]
    # as torch stores the GEMM output: rounded to the activation dtype
    y = acc.to(ACT)
    out = out_ptr + rm[:, None] * stride_om + rows[None, :]
    smask = mmask[:, None] & nmask[None, :]
    if EPILOGUE == 1:
        y = silu_mul(y, acc_up.to(ACT))
    elif EPILOGUE == 2:
        # each column's partner through a 0/1 permutation matrix: exact in fp32 accumulation
        swap = (cols[:, None] == (cols[None, :] + hb) % BN).to(ACT)
        partner = tl.dot(y, swap, input_precision=PRECISION)
        pos = tl.load(pos_ptr + rm, mask=mmask, other=0)
        d = rows % HEAD_DIM % half
        cos = tl.load(cos_ptr + pos[:, None] * stride_c + d[None, :])
        sin = tl.load(sin_ptr + pos[:, None] * stride_c + d[None, :])
        # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (neox)
        signed_sin = tl.where((cols < hb)[None, :], -sin, sin)
        x = y.to(tl.float32)
        y = tl.where((rows < ROT_ROWS)[None, :], x * cos + partner * signed_sin, x).to(ACT)
    tl.store(out, rows_out(y, out_ptr, ACT), mask=smask)


def default_config(rows: int, k: int, fp8: bool = False, x_half: bool = False) -> GemvConfig:
    """Enough programs to cover the SMs, each streaming a long run of K. Up to 8192 rows
    (FP8: any) 32 columns over runs of 512, chosen with bench/decode_profile.py on the 8B
    shapes at 2-8 rows (bench/RESULTS.md, decode GEMMs alone); wider (an lm_head) 32
    columns over runs of 256. FP8 with x already float16 (x_half: the down projection fed
    by gate|up, o by attention, timed on the 8B's; a float16 model's FP8 GEMMs take it too,
    untimed) runs of 256 in 4 stages ("float16 rows for the down projection")."""
    if fp8 and x_half and k % 256 == 0:
        return GemvConfig(32, 256, 4, 4)
    if k % 512 == 0 and (fp8 or rows <= 8192):
        return GemvConfig(32, 512, 4, 3)
    block_n = 16 if rows <= 8192 else 32
    return GemvConfig(block_n, 256 if k % 256 == 0 else 128, 4, 4)


def silu_mul_config(n: int, k: int, fp8: bool = False) -> GemvConfig:
    """gate|up streams two weight rows per output column: wider, shorter tiles (FP8: 64
    columns over runs of 256 in 3 stages, the fastest on the 8B's at 2-16 rows, x in
    bfloat16 or already float16; bench/RESULTS.md, "Since: gate|up's tile" and
    "float16 rows from the norms and attention"). The tile must divide n (ops only sends
    n % 16 == 0 here)."""
    if fp8 and n % 64 == 0 and n >= 4096 and k % 256 == 0:
        return GemvConfig(64, 256, 4, 3)
    if fp8 and n % 32 == 0 and n >= 4096 and k % 256 == 0:
        return GemvConfig(32, 256, 4, 4)
    if n % 64 == 0 and n >= 4096:
        return GemvConfig(64, 128, 4, 4)
    cfg = default_config(2 * n, k)
    return cfg if n % cfg.block_n == 0 else cfg._replace(block_n=16)


def rotary_config(n: int, k: int, head_dim: int, fp8: bool = False,
                  x_half: bool = False) -> GemvConfig:
    """q|k|v rows: 32 columns (16 rotation pairs) per program where the heads allow it,
    else 16 (ops only sends head_dim % 16 == 0 here); FP8, 64 columns where they fit, over
    runs of 256 in 3 stages for bfloat16 x, of 512 for x already float16 (a norm's float16
    rows; timed on the 8B's at 2-16 rows: bench/RESULTS.md, "x in float16 for every FP8
    GEMM" and "float16 rows from the norms and attention")."""
    wide = fp8 and n % 64 == 0 and (head_dim // 2) % 32 == 0
    if wide and x_half and k % 512 == 0:
        return GemvConfig(64, 512, 4, 3)
    if wide and k % 256 == 0:
        return GemvConfig(64, 256, 4, 3)
    if n % 32 == 0 and (head_dim // 2) % 16 == 0:
        return GemvConfig(32, 512, 4, 3) if fp8 and k % 512 == 0 else GemvConfig(32, 128, 4, 6)
    return GemvConfig(16, 256 if k % 256 == 0 else 128, 4, 4)


def supports(x: torch.Tensor, w: Weight) -> bool:
    """Shapes and dtypes the skinny path takes; everything else goes to cuBLAS."""
    if isinstance(w, Fp8Weight):
        return _supports_fp8(x, w)
    return (x.dim() == 2 and x.shape[0] <= MAX_M and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and x.stride(1) == 1 and w.stride(1) == 1
            and w.shape[1] % 128 == 0)


def _supports_fp8(x: torch.Tensor, w: Fp8Weight) -> bool:
    """An FP8 weight's: e4m3 rows, float32 scales one a row or one a row and a power-of-two
    group of 16+ columns (a tile is one group, or whole groups)."""
    k, groups = w.shape[1], w.scale.shape[1]
    return (x.dim() == 2 and x.shape[0] <= MAX_M_FP8
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and w.data.dtype == FP8 and w.data.stride(1) == 1
            and fp8_columns_ok(k, k if groups == 1 else w.group)
            and (groups == 1 or w.scale.stride(1) == 1) and w.scale.dtype == torch.float32)


class _Operands(NamedTuple):
    """A weight as the kernels take it: its rows, scales, columns per scale."""

    data: torch.Tensor  # [N, K] in x's dtype, or e4m3
    scales: torch.Tensor  # [N, K / group] float32 (FP8), else any tensor (not read)
    fp8: bool
    group: int  # K: one scale a row


def _operands(w: Weight) -> _Operands:
    if not isinstance(w, Fp8Weight):
        return _Operands(w, w, False, w.shape[1])
    group = w.shape[1] if w.scale.shape[1] == 1 else w.group
    return _Operands(w.data, w.scale, True, group)


def _block_k(block_k: int, ops: _Operands, rows: int) -> int:
    """A grouped FP8 weight's tiles: one group (the tensor-core kernel scales each tile's
    product) or whole groups (the row kernel)."""
    if not ops.fp8 or ops.group == ops.data.shape[1]:
        return block_k
    return max(block_k, ops.group) if rows == 1 else ops.group


def _f16_dot(o: _Operands, dtype: torch.dtype, epilogue: int) -> int:
    """How the tensor-core kernel meets e4m3 tiles with bfloat16 x: in float16 (e4m3 widens
    to float16 in one conversion a pair, to bfloat16 in three), x converted once a program
    as loaded; a grouped gate|up, whose tiles are one group wide, converts it where the dot
    takes it: the extra pass through shared memory costs it more (bench/RESULTS.md, "x in
    float16 for every FP8 GEMM")."""
    if not (o.fp8 and dtype == torch.bfloat16):
        return X_AS_IS
    grouped = o.group < o.data.shape[1]
    return X_HALF_IN_DOT if grouped and epilogue == SILU_MUL else X_HALF_ONCE


def _launch(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, out: torch.Tensor,
            act: torch.dtype, n: int, epilogue: int, programs: int, cfg: GemvConfig,
            rope=None, head_dim: int = 0, rot_rows: int = 0) -> torch.Tensor:
    """Launches the row kernel (one token) or the tensor-core kernel, which computes in
    `act` whatever x's and out's dtypes (float16 rows standing for `act`'s)."""
    pos, cos, sin = rope if rope is not None else (out, out, out)
    o = _operands(w)
    k = o.data.shape[1]
    fixed = dict(N=n, K=k, EPILOGUE=epilogue, HAS_BIAS=bias is not None, HEAD_DIM=head_dim,
                 ROT_ROWS=rot_rows, FP8=o.fp8, GROUP=o.group, BN=cfg.block_n,
                 BK=_block_k(cfg.block_k, o, x.shape[0]), num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)
    b = bias if bias is not None else o.data
    if x.shape[0] == 1 and x.dtype != torch.float32:  # the row kernel: PDL at one token
        row_kernel[(programs,)](
            x, o.data, o.scales, b, out, pos, cos, sin, o.data.stride(0),
            o.scales.stride(0), cos.stride(0), SUM_EACH=cfg.sum_each, **fixed, **pdl(x, 1))
        return out
    _gemv_kernel[(programs,)](
        x, o.data, o.scales, b, out, pos, cos, sin,
        x.shape[0], x.stride(0), o.data.stride(0), o.scales.stride(0), out.stride(0),
        cos.stride(0), BM=max(BM, triton.next_power_of_2(x.shape[0])),
        F16=_f16_dot(o, x.dtype, epilogue), ACT=TL_DTYPES[act],
        # fp32 models stay fp32: tl.dot would otherwise round its inputs to tf32
        PRECISION="ieee" if act == torch.float32 else "tf32", **fixed)
    return out


def _computed_in(x: torch.Tensor, act: torch.dtype | None) -> torch.dtype:
    """The dtype the kernels compute x's product in: `act` (the dtype float16 rows stand
    for), else x's. The row kernel (one token) takes no float16 rows standing for others."""
    if act is not None and act != x.dtype and x.shape[0] == 1:
        raise ValueError("float16 rows standing for another dtype are the tensor-core "
                         "kernel's (2+ rows)")
    return act or x.dtype


def gemv(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
         cfg: GemvConfig | None = None, act: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) for M <= MAX_M (MAX_M_FP8), computed and returned in
    `act` (x's unless given: float16 rows standing for bfloat16 ones give bfloat16)."""
    n, k, fp8 = w.shape[0], w.shape[1], isinstance(w, Fp8Weight)
    cfg = cfg or (row_config(n, k, fp8) if x.shape[0] == 1
                  else default_config(n, k, fp8, x.dtype == torch.float16))
    act = _computed_in(x, act)
    out = torch.empty(x.shape[0], n, dtype=act, device=x.device)
    return _launch(x, w, bias, out, act, n, PLAIN, triton.cdiv(n, cfg.block_n), cfg)


def gemv_silu_mul(x: torch.Tensor, w: Weight, cfg: GemvConfig | None = None,
                  half: bool = False, act: torch.dtype | None = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) with w = [gate | up] stacked on rows: [M, N/2],
    computed in `act` (as gemv). half (2+ rows): stored in float16 clamped to its range
    (rows standing for `act`'s), as an FP8 GEMM's float16 dot takes them."""
    n, k, fp8 = w.shape[0] // 2, w.shape[1], isinstance(w, Fp8Weight)
    cfg = cfg or (row_config(n, k, fp8, row_sets=2) if x.shape[0] == 1
                  else silu_mul_config(n, k, fp8))
    if n % cfg.block_n:
        raise ValueError(f"gate/up width {n} is not a multiple of {cfg.block_n}")
    if half and x.shape[0] == 1:
        raise ValueError("float16 rows are the tensor-core kernel's (2+ rows)")
    act = _computed_in(x, act)
    out = torch.empty(x.shape[0], n, dtype=torch.float16 if half else act, device=x.device)
    return _launch(x, w, None, out, act, n, SILU_MUL, n // cfg.block_n, cfg)


def gemv_rotary(x: torch.Tensor, w: Weight, bias: torch.Tensor | None,
                positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                head_dim: int, rot_heads: int, cfg: GemvConfig | None = None,
                act: torch.dtype | None = None) -> torch.Tensor:
    """x @ w^T (+ bias) over head-major rows, the first `rot_heads` heads rotated (neox);
    computed and returned in `act` (as gemv)."""
    # w: [num_heads * head_dim, K]; cos/sin: [max_pos, head_dim / 2] fp32
    n, k, fp8 = w.shape[0], w.shape[1], isinstance(w, Fp8Weight)
    cfg = cfg or (row_config(n, k, fp8) if x.shape[0] == 1
                  else rotary_config(n, k, head_dim, fp8, x.dtype == torch.float16))
    if (head_dim // 2) % (cfg.block_n // 2) or n % head_dim:
        raise ValueError(f"head_dim {head_dim} / rows {n} do not tile by {cfg.block_n}")
    act = _computed_in(x, act)
    out = torch.empty(x.shape[0], n, dtype=act, device=x.device)
    return _launch(x, w, bias, out, act, n, ROTARY, n // cfg.block_n, cfg,
                   (positions, cos, sin), head_dim, rot_heads * head_dim)
