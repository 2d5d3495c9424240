"""Fused Triton kernels for the per-token ops that otherwise cost many small launches
(GPU only; imported lazily by model/ops.py, which keeps the torch references)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from raygraph.model.fp8_rows import Quantized
from raygraph.model.triton_pdl import await_inputs, launch_next, pdl

# Triton's interpreter (CPU tests) runs no PTX: kernels with inline asm convert as torch does
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

# float16 rows standing for rows of another dtype (fp8_rows.STANDS_FOR): kernels take the
# activations' dtype as a constexpr, to compute in it whatever dtype their rows are stored in
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def to_float16(v, ONCE: tl.constexpr):
    """v in float16, clamped to its range, NaN kept (a bfloat16 value keeps all its bits
    within float16's normal range). ONCE: a bfloat16 pair in one instruction (the clamp
    included), an impure asm the compiler cannot move: converted in the layout v has, not
    sunk into where it is used."""
    if ONCE and v.dtype == tl.bfloat16 and not INTERPRETED:
        v = tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xffff0000; "
            "cvt.rn.satfinite.f16x2.f32 $0, hi, lo; }",
            "=r,r", [v], dtype=tl.float16, is_pure=False, pack=2)
    else:
        v = tl.clamp(v.to(tl.float32), -65504.0, 65504.0,
                     propagate_nan=tl.PropagateNan.ALL).to(tl.float16)
    return v


@triton.jit
def rows_out(y, out_ptr, ACT: tl.constexpr):
    """y as a kernel stores its rows in out_ptr: rounded to the activation dtype ACT, as
    torch would store them, then in float16 standing for them where out is float16 and ACT
    is not (`to_float16`)."""
    y = y.to(ACT)
    if (out_ptr.dtype.element_ty == tl.float16) and (ACT != tl.float16):
        y = to_float16(y, True)
    return y


@triton.jit
def _store_e4m3(y, scale, cols, mask, q_ptr, s_ptr, row, n, fp8_max):
    """Stores row `row` of y (float32) in e4m3 at `scale`, y / scale rounded as torch
    divides (not y times 1 / scale), and the scale."""
    q = tl.clamp(tl.math.div_rn(y, tl.zeros_like(y) + scale), -fp8_max, fp8_max)
    tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quantize_row(y, cols, mask, q_ptr, s_ptr, row, n, fp8_max, inv_max, min_scale):
    """Stores row `row` of y (float32) in e4m3 with its per-token scale, as quant.quantize
    computes them: the largest magnitude maps to 448."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) * inv_max, min_scale)
    _store_e4m3(y, scale, cols, mask, q_ptr, s_ptr, row, n, fp8_max)


@triton.jit
def _normed(t, w, n, eps, ACT: tl.constexpr):
    """RMSNorm of row t (float32) as HF computes it: normalised, cast to the activation
    dtype ACT, scaled by the weight, cast again."""
    normed = t * tl.rsqrt(tl.sum(t * t, axis=0) / n + eps)
    return (normed.to(ACT).to(tl.float32) * w).to(ACT)


@triton.jit
def _store_normed(t, w, out_ptr, q_ptr, s_ptr, row, cols, mask, n, eps, fp8_max, inv_max,
                  min_scale, ACT: tl.constexpr, QUANT: tl.constexpr, KEEP: tl.constexpr):
    """RMSNorm of row t (`_normed`). KEEP: the row stored (`rows_out`); QUANT: also in
    e4m3 per token (what an FP8 GEMM taking it would compute from it; without KEEP, only
    so)."""
    y = _normed(t, w, n, eps, ACT)
    if KEEP:
        tl.store(out_ptr + row * n + cols, rows_out(y, out_ptr, ACT), mask=mask)
    if QUANT:
        _quantize_row(y.to(tl.float32), cols, mask, q_ptr, s_ptr, row, n, fp8_max, inv_max,
                      min_scale)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, stride_x, n, eps, fp8_max, inv_max,
                     min_scale, BLOCK: tl.constexpr, QUANT: tl.constexpr, KEEP: tl.constexpr,
                     PDL: tl.constexpr):
    launch_next(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    await_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _store_normed(x, w, out_ptr, q_ptr, s_ptr, row, cols, mask, n, eps, fp8_max, inv_max,
                  min_scale, x_ptr.dtype.element_ty, QUANT, KEEP)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, stride_x,
                         stride_r, n, eps, fp8_max, inv_max, min_scale, BLOCK: tl.constexpr,
                         QUANT: tl.constexpr, KEEP: tl.constexpr, PDL: tl.constexpr):
    launch_next(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    await_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    total = x + r  # in the activation dtype, as torch adds
    tl.store(sum_ptr + row * n + cols, total, mask=mask)
    _store_normed(total.to(tl.float32), w, out_ptr, q_ptr, s_ptr, row, cols, mask, n, eps,
                  fp8_max, inv_max, min_scale, sum_ptr.dtype.element_ty, QUANT, KEEP)


@triton.jit
def _qk_norm_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, oq_ptr, ok_ptr, stride_qt, stride_kt, eps,
                    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """Programs (token, head) over q's heads then k's: each head's row normalised with its
    own weight (q's or k's) as _rms_norm_kernel normalises a row."""
    launch_next(PDL)
    r = tl.program_id(0)
    tok, h = r // (HQ + HK), r % (HQ + HK)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    is_q = h < HQ
    w = tl.load(tl.where(is_q, wq_ptr, wk_ptr) + cols, mask=mask, other=0.0).to(tl.float32)
    src = tl.where(is_q, q_ptr + tok * stride_qt + h * D, k_ptr + tok * stride_kt + (h - HQ) * D)
    dst = tl.where(is_q, oq_ptr + (tok * HQ + h) * D, ok_ptr + (tok * HK + h - HQ) * D)
    await_inputs(PDL)
    x = tl.load(src + cols, mask=mask, other=0.0)
    tl.store(dst + cols, _normed(x.to(tl.float32), w, D, eps, x.dtype), mask=mask)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(q), rms_norm(k)) over heads, q [T, Hq, D] and k [T, Hk, D] (views of one
    projection's rows: each head's D contiguous), in one launch: contiguous results, equal
    to the two rms_norm launches'."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1):
        raise ValueError("q and k need each head's dims contiguous, heads side by side")
    out_q = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    out_k = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    _qk_norm_kernel[(t * (hq + hk),)](q, k, q_weight, k_weight, out_q, out_k, q.stride(0),
                                      k.stride(0), eps, HQ=hq, HK=hk, D=d,
                                      BLOCK=triton.next_power_of_2(d), num_warps=4,
                                      **pdl(q, t))
    return out_q, out_k


def _outputs(shape: tuple[int, int], like: torch.Tensor, quantize: bool, keep: bool,
             half: bool = False) -> tuple[torch.Tensor, Quantized | None, tuple]:
    """What a fused kernel making rows [T, n] fills: the rows in `like`'s dtype (`half`: in
    float16, standing for them; not `keep`: an unwritten one-element stand-in, expanded to
    the shape, whose consumer reads only the e4m3 rows: ops.fp8_gemm); with `quantize` the
    e4m3 rows and scales, or None; and its q_ptr, s_ptr and the quantization constants (not
    quantizing, the rows stand in for the pointers, which the kernel then never reads)."""
    from raygraph.model.quant import FP8, FP8_MAX, INV_FP8_MAX, MIN_SCALE

    if not (keep or quantize):
        raise ValueError("a kernel that neither keeps nor quantizes its rows stores nothing")
    if keep:
        out = torch.empty(shape, dtype=torch.float16 if half else like.dtype,
                          device=like.device)
    else:
        out = torch.empty(1, dtype=like.dtype, device=like.device).expand(shape)
    if not quantize:
        return out, None, (out, out, FP8_MAX, INV_FP8_MAX, MIN_SCALE)
    q = torch.empty(shape, dtype=FP8, device=like.device)
    scales = torch.empty(shape[0], 1, dtype=torch.float32, device=like.device)
    return out, (q, scales), (q, scales, FP8_MAX, INV_FP8_MAX, MIN_SCALE)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the row: the norm kernels' layout (any
    leading dims; a view when x allows it)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool = False, keep: bool = True, half: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, Quantized | None]:
    """(rms_norm(x + residual), x + residual, and with `quantize` the normed rows in e4m3
    per token) in one launch; `keep` and `half` (the normed rows) as _outputs."""
    x2, r2 = _rows(x), _rows(residual)
    t, n = x2.shape
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out, quantized, qargs = _outputs((t, n), x, quantize, keep, half)
    _add_rms_norm_kernel[(t,)](x2, r2, weight, out, total, *qargs[:2], x2.stride(0),
                               r2.stride(0), n, eps, *qargs[2:],
                               BLOCK=triton.next_power_of_2(n), QUANT=quantize, KEEP=keep,
                               num_warps=4, **pdl(x, t))
    return out.reshape(x.shape), total.view(x.shape), quantized


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, stride, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_next(PDL)
    await_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + row * stride + c, mask=c < n, other=float("-inf")).to(tl.float32)
        take = x > best  # strict: each lane keeps its first occurrence
        best = tl.where(take, x, best)
        idx = tl.where(take, c, idx)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, idx, n), axis=0).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax, the first index on ties (as torch); one program a row. torch's reduction
    took 10 us for one 32000-wide row inside the decode graph."""
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    block = min(triton.next_power_of_2(x.shape[1]), 16384)
    _argmax_kernel[(x.shape[0],)](x, out, x.stride(0), x.shape[1], BLOCK=block, num_warps=16,
                                   **pdl(x, x.shape[0]))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False,
             keep: bool = True, half: bool = False) -> tuple[torch.Tensor, Quantized | None]:
    """(rms_norm(x), and with `quantize` its rows in e4m3 per token) in one launch; `keep`
    and `half` as _outputs."""
    x2 = _rows(x)
    t, n = x2.shape
    out, quantized, qargs = _outputs((t, n), x, quantize, keep, half)
    _rms_norm_kernel[(t,)](x2, weight, out, *qargs[:2], x2.stride(0), n, eps, *qargs[2:],
                           BLOCK=triton.next_power_of_2(n), QUANT=quantize, KEEP=keep,
                           num_warps=4, **pdl(x, t))
    return out.reshape(x.shape), quantized


@triton.jit
def _rope_heads(ptr, stride_h, cos, sin, H: tl.constexpr, H_PAD: tl.constexpr,
                HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    off = ptr + h * stride_h + d
    m = (h < H) & (d < HALF)
    x1 = tl.load(off, mask=m).to(tl.float32)
    x2 = tl.load(off + HALF, mask=m).to(tl.float32)
    tl.store(off, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=m)
    tl.store(off + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_c, HQ: tl.constexpr, HK: tl.constexpr,
                   HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF_PAD)  # heads of 80, 96 or 100: half a head is no power of two
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)[None, :]
    _rope_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, HQ, HQ_PAD, HALF, HALF_PAD)
    _rope_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, HK, HK_PAD, HALF, HALF_PAD)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor) -> None:
    """Neox rotary applied in place to q [T, Hq, D] and k [T, Hk, D] (strided views are fine)."""
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), HQ=hq, HK=hk, HQ_PAD=triton.next_power_of_2(hq),
        HK_PAD=triton.next_power_of_2(hk), HALF=d // 2,
        HALF_PAD=triton.next_power_of_2(d // 2), num_warps=1,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    tl.store(out_ptr + row * stride_o + cols,
             _silu_mul(x_ptr + row * stride_x, cols, mask, n), mask=mask)


@triton.jit
def _silu_mul(x_row, cols, mask, n):
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n + cols, mask=mask, other=0.0)
    # as torch: silu in the activation dtype, then the product
    return (gate * tl.sigmoid(gate)).to(up.dtype) * up


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_o, n, fp8_max,
                               inv_max, min_scale, BLOCK: tl.constexpr, WHOLE: tl.constexpr,
                               KEEP: tl.constexpr):
    """One program a row. WHOLE (BLOCK >= n): the row in registers, stored, then stored in
    e4m3. Else two passes over it in pieces: the product stored and its largest magnitude
    found, then the stored row read back (from L2) and stored in e4m3 (`silu_and_mul` says
    when: many rows that are kept too, or very wide ones). Without KEEP the row is stored
    in e4m3 only (the second pass computes it again from its input, which L2 still
    holds)."""
    row = tl.program_id(0)
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_o
    if WHOLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        y = _silu_mul(x_row, cols, mask, n)
        if KEEP:
            tl.store(out_row + cols, y, mask=mask)
        _quantize_row(y.to(tl.float32), cols, mask, q_ptr, s_ptr, row, n, fp8_max, inv_max,
                      min_scale)
    else:
        top = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n
            y = _silu_mul(x_row, cols, mask, n)
            if KEEP:
                tl.store(out_row + cols, y, mask=mask)
            top = tl.maximum(top, tl.abs(y.to(tl.float32)))
        scale = tl.maximum(tl.max(top, axis=0) * inv_max, min_scale)
        if KEEP:
            tl.debug_barrier()  # the row's stores visible to every thread of the program
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n
            if KEEP:
                y = tl.load(out_row + cols, mask=mask, other=0.0)
            else:
                y = _silu_mul(x_row, cols, mask, n)
            _store_e4m3(y.to(tl.float32), scale, cols, mask, q_ptr, s_ptr, row, n, fp8_max)


# SwiGLU with e4m3 rows holds each row whole in registers below SILU_PIECES_FROM rows;
# from there, a row it also stores in the activation dtype (`keep`), or one wider than
# WHOLE_ROW columns, goes in pieces (bench/RESULTS.md, "FP8 served": at 2,048 rows of
# 14,336 columns the whole row is faster with e4m3 rows only, the pieces with both)
SILU_PIECES_FROM, WHOLE_ROW = 1024, 16384


def silu_and_mul(x: torch.Tensor, quantize: bool = False, keep: bool = True
                 ) -> tuple[torch.Tensor, Quantized | None]:
    """(silu(gate) * up of x = [gate | up], and with `quantize` its rows in e4m3 per token)
    in one launch; `keep` as _outputs."""
    num_tokens, n = x.shape[0], x.shape[1] // 2
    out, quantized, qargs = _outputs((num_tokens, n), x, quantize, keep)
    if quantize:
        whole = num_tokens < SILU_PIECES_FROM or not (keep or n > WHOLE_ROW)
        block = triton.next_power_of_2(n) if whole else 1024
        _silu_and_mul_quant_kernel[(num_tokens,)](x, out, *qargs[:2], x.stride(0),
                                                  out.stride(0), n, *qargs[2:], BLOCK=block,
                                                  WHOLE=whole, KEEP=keep,
                                                  num_warps=16 if block >= 8192 else 4)
    else:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, 1024))](
            x, out, x.stride(0), out.stride(0), n, BLOCK=1024, num_warps=4)
    return out, quantized


@triton.jit
def to_cache(x, cache_ptr):
    """x in the KV cache's dtype; an FP8 cache saturates at +-448 (e4m3's largest finite
    value), as ops.to_cache does."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_k, stride_v,
                     N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:  # NOTE: padding slots are -1 and write nothing
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        k = to_cache(tl.load(k_ptr + t * stride_k + cols, mask=mask), kc_ptr)
        v = to_cache(tl.load(v_ptr + t * stride_v + cols, mask=mask), vc_ptr)
        tl.store(kc_ptr + slot * N + cols, k, mask=mask)
        tl.store(vc_ptr + slot * N + cols, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k: [T, Hkv, D] (heads contiguous within a token); caches contiguous
    n = k.shape[1] * k.shape[2]
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), N=n, BLOCK=triton.next_power_of_2(n),
                                    num_warps=1)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, stride_x, n, fp8_max, inv_max,
                          min_scale, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        _store_e4m3(x, tl.load(static_ptr), cols, mask, q_ptr, s_ptr, row, n, fp8_max)
    else:
        _quantize_row(x, cols, mask, q_ptr, s_ptr, row, n, fp8_max, inv_max, min_scale)


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x [T, K], float32 scales [T, 1]) in one launch: each token scaled so its
    largest magnitude is e4m3's 448, or by the static scale [1]; as quant.quantize and
    quant.quantize_with compute them."""
    from raygraph.model.quant import FP8, FP8_MAX, INV_FP8_MAX, MIN_SCALE

    t, n = x.shape
    q = torch.empty(t, n, dtype=FP8, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _quantize_rows_kernel[(t,)](x, q, scales, scales if static is None else static,
                                x.stride(0), n, FP8_MAX, INV_FP8_MAX, MIN_SCALE,
                                STATIC=static is not None,
                                BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return q, scales
