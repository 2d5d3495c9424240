"""The row kernel: skinny GEMMs of one token (M = 1, batch-1 decode), GPU only; launched by
triton_gemv.py, which imports from here the epilogue helpers both kernels use and the
config type.

No tensor-core tile to fill, so each program reduces a few columns with FMAs and there are
several programs per SM: more weight bytes are in flight, and the small GEMMs stream
faster (bench/RESULTS.md, third decode pass). One-token steps launch it with programmatic
dependent launch (triton_pdl.py): whatever is a weight or a step input (FP8 scales, bias,
the token's rotation) is read before the wait for the kernel before.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from raygraph.model.triton_pdl import await_inputs, launch_next

PLAIN, SILU_MUL, ROTARY = 0, 1, 2
ONE_RUN_FP8 = 32768  # the longest FP8 row the row kernel reads in one run (2 rows, 8 warps)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    sum_each: bool = False  # the row kernel: reduce each tile at once (fewer registers)


@triton.jit
def pair_base(pid, HB: tl.constexpr, HEAD_DIM: tl.constexpr):
    """ROTARY: the first row program `pid` owns. A program holds HB rotation pairs of one
    head: dims base.. of its first half and their partners base + D/2.."""
    per_head: tl.constexpr = HEAD_DIM // 2 // HB
    return (pid // per_head) * HEAD_DIM + (pid % per_head) * HB


@triton.jit
def silu_mul(gate, up):
    """SwiGLU rounded as the unfused ops round: gate and up already in the output dtype."""
    g = gate.to(tl.float32)
    return (g * tl.sigmoid(g)).to(gate.dtype) * up


@triton.jit
def _row_products(x, w, ws_rows, k0, FP8: tl.constexpr, GROUP: tl.constexpr,
                  K: tl.constexpr, BK: tl.constexpr):
    """[rows, BK] the row kernel's products of x [1, BK] (float32) and a weight tile; a
    grouped FP8 tile's scaled per group (a tile holds BK / GROUP whole groups; those past K
    read no scale)."""
    p = w.to(tl.float32) * x
    if FP8 and GROUP < K:
        groups: tl.constexpr = BK // GROUP
        g = k0 // GROUP + tl.arange(0, groups)[None, :]
        s = tl.load(ws_rows[:, None] + g, mask=g < K // GROUP, other=0.0)
        p = tl.reshape(tl.reshape(p, (p.shape[0], groups, GROUP)) * s[:, :, None], p.shape)
    return p


@triton.jit
def _reduced(p, SUM_EACH: tl.constexpr):
    """A tile's products as the row kernel accumulates them: whole, or summed per row."""
    if SUM_EACH:
        p = tl.sum(p, axis=1, keep_dims=True)
    return p


@triton.jit
def _run(w_rows, k0, rmask, rk, K: tl.constexpr, BK: tl.constexpr):
    """The row kernel's weight tile of K run k0 (e4m3 or the activation dtype): rows off
    `rmask`, and columns past K (the last run of a K that BK does not divide) read 0; a run
    starting at or past K reads nothing."""
    if K % BK == 0:
        mask = rmask[:, None] & (k0 < K)
    else:
        mask = rmask[:, None] & (k0 + rk < K)[None, :]
    return tl.load(w_rows + k0, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _row_values(a_ptrs, b_ptrs, mask, LOAD: tl.constexpr, LOAD_B: tl.constexpr,
                NEUTRAL: tl.constexpr):
    """The row kernel's float32 values a row of its two row sets (FP8 scales or a bias):
    loaded where LOAD (the second set where LOAD_B too; rows off `mask` read 0), else
    NEUTRAL (1.0 for a scale, 0.0 for a bias)."""
    a = tl.full(a_ptrs.shape, NEUTRAL, tl.float32)
    b = a
    if LOAD:
        a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
        if LOAD_B:
            b = tl.load(b_ptrs).to(tl.float32)
    return a, b


@triton.jit
def _row_rotation(pos_ptr, cos_ptr, sin_ptr, d, stride_c, ROTARY: tl.constexpr):
    """ROTARY: the token's cos and sin at dims `d` (its position is a step input, which no
    kernel of the chain writes: read before the wait too); else ones and zeros."""
    cos = tl.full(d.shape, 1.0, tl.float32)
    sin = tl.zeros(d.shape, tl.float32)
    if ROTARY:
        at = tl.load(pos_ptr) * stride_c + d
        cos = tl.load(cos_ptr + at)
        sin = tl.load(sin_ptr + at)
    return cos, sin


@triton.jit
def row_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_wn,
    stride_ws, stride_c, N: tl.constexpr, K: tl.constexpr, EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_ROWS: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_EACH: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token (M = 1): no tensor-core tile to fill, so a program's columns are FMA
    reductions over K and tiles can be narrow: many programs, several per SM, keep more
    weight bytes in flight than one 16-column dot tile per SM. SILU_MUL and ROTARY stream two
    row sets: gate and up rows, or dims d and d + D/2 of a head. FP8 as in _gemv_kernel, but
    a grouped weight's tile holds BK / GROUP groups. A program loads each next run of K while
    it multiplies one, the first before its input is ready (PDL); a run may pass K (a whole
    row in one run: all of a program's bytes in flight at once)."""
    launch_next(PDL)
    pid = tl.program_id(0)
    if EPILOGUE == 2:
        rows = pair_base(pid, BN // 2, HEAD_DIM) + tl.arange(0, BN // 2)
        partner = rows + HEAD_DIM // 2
    else:
        rows = pid * BN + tl.arange(0, BN)
        partner = rows + N  # SILU_MUL: the up row beside gate row n
    nmask = rows < N
    bmask = tl.full(partner.shape, True, tl.int1)  # every partner row exists
    rk = tl.arange(0, BK)
    w_a = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    w_b = w_ptr + partner.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    # FP8 scale rows (a masked-off row reads row 0's)
    s_a = ws_ptr + tl.where(nmask, rows, 0).to(tl.int64) * stride_ws
    s_b = ws_ptr + partner.to(tl.int64) * stride_ws
    # SUM_EACH: [rows] sums, each tile reduced as it is read, so the registers hold the
    # weight tiles in flight rather than [rows, BK] partial products
    width: tl.constexpr = 1 if SUM_EACH else BK
    acc = tl.zeros([rows.shape[0], width], tl.float32)
    acc_b = tl.zeros([rows.shape[0], width], tl.float32)
    w = _run(w_a, 0, nmask, rk, K, BK)
    wb = w
    if EPILOGUE != 0:
        wb = _run(w_b, 0, bmask, rk, K, BK)
    # the rows' scales and bias are weights too: read before the wait, off the chain
    scale_a, scale_b = _row_values(s_a, s_b, nmask, FP8 and GROUP == K, EPILOGUE != 0, 1.0)
    bias_a, bias_b = _row_values(b_ptr + rows, b_ptr + partner, nmask, HAS_BIAS,
                                 EPILOGUE == 2, 0.0)
    cos, sin = _row_rotation(pos_ptr, cos_ptr, sin_ptr, rows % HEAD_DIM, stride_c,
                             EPILOGUE == 2)
    await_inputs(PDL)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            x = tl.load(x_ptr + k0 + rk)
        else:
            x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0)
        x = x.to(tl.float32)[None, :]
        w_next = _run(w_a, k0 + BK, nmask, rk, K, BK)
        acc += _reduced(_row_products(x, w, s_a, k0, FP8, GROUP, K, BK), SUM_EACH)
        w = w_next
        if EPILOGUE != 0:
            wb_next = _run(w_b, k0 + BK, bmask, rk, K, BK)
            acc_b += _reduced(_row_products(x, wb, s_b, k0, FP8, GROUP, K, BK), SUM_EACH)
            wb = wb_next
    y = tl.sum(acc, axis=1) * scale_a + bias_a
    y_b = tl.sum(acc_b, axis=1) * scale_b + bias_b
    dtype = out_ptr.dtype.element_ty
    if EPILOGUE == 0:
        tl.store(out_ptr + rows, y.to(dtype), mask=nmask)
    elif EPILOGUE == 1:
        tl.store(out_ptr + rows, silu_mul(y.to(dtype), y_b.to(dtype)), mask=nmask)
    else:
        a = y.to(dtype).to(tl.float32)
        b = y_b.to(dtype).to(tl.float32)
        rot = rows < ROT_ROWS
        tl.store(out_ptr + rows, tl.where(rot, a * cos - b * sin, a).to(dtype))
        tl.store(out_ptr + partner, tl.where(rot, b * cos + a * sin, b).to(dtype))


def _longest(k: int, runs: tuple[int, ...]) -> int:
    return next(b for b in runs if k % b == 0)


def row_config(n: int, k: int, fp8: bool = False, row_sets: int = 1) -> GemvConfig:
    """M = 1 (the row kernel): narrow tiles, long K runs, chosen with bench/decode_profile.py
    (bench/RESULTS.md: "One-token GEMVs" and the sections after it). FP8 rows are half the
    bytes, each tile summed as read. Past 2048 columns, up to ONE_RUN_FP8, a program reads
    its rows in one run of the next power of two (loads past K masked), so all of its bytes
    are in flight at once: 4 rows at 4 warps over 4096; from 8192 on, 256 weight bytes a
    thread over its `row_sets`. 4096 x 4096 takes 8 rows at 8 warps (64 registers): its
    programs launch beside attention, and more of its weight is in flight there. Longer
    rows take 8 over runs of 1024, shorter 4 over their whole length. bf16: 4 rows a program
    up to 4096 rows, else 2, over runs of up to 1024 (2048 for short rows); a narrow
    tensor-parallel shard (under 4096 rows over K 4096, or 4096 over K 2048) 2 at 2 warps,
    twice the programs; a K past 2048 that runs of 1024 do not divide, 2 rows over runs of
    4096, the last one masked."""
    run = triton.next_power_of_2(k)
    if fp8 and n == k == 4096:
        return GemvConfig(8, 4096, 8, 1, True)
    if fp8 and 2048 < k and run <= ONE_RUN_FP8:
        warps = max(4, run // 4096)
        # from 8192 on, 256 weight bytes a thread over every row set
        rows = 4 if run == 4096 else max(1, 256 * 32 * warps // (run * row_sets))
        return GemvConfig(rows, run, warps, 1, True)
    if fp8 and k > 2048:
        return GemvConfig(8, _longest(k, (1024, 512, 256, 128)), 4, 1, True)
    if fp8:
        return GemvConfig(4, _longest(k, (2048, 1024, 512, 256, 128)), 4, 1, True)
    if k > 2048 and k % 1024:
        return GemvConfig(2, 4096, 4, 1, True)
    if n < 4096 and k == 4096 or n == 4096 and k == 2048:
        return GemvConfig(2, 1024, 2, 1)
    if n <= 4096 and k == 4096:
        return GemvConfig(4, 1024, 4, 1, True)
    if n <= 4096:
        return GemvConfig(4, _longest(k, (2048, 1024, 512, 256, 128)), 4, 1)
    return GemvConfig(2, _longest(k, (1024, 512, 256, 128)), 2, 1)
