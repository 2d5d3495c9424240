"""Triton paged decode attention (GPU only; imported lazily), split over the KV length.

Programs are (sequence, KV head, split); each split walks its share of the sequence's
tokens up to `seq_lens[b]`, read from device memory, so the launch shape depends only on
the batch bucket and the block-table width: one captured graph serves every batch that
fits it. A merge kernel then folds the splits; at one split a sequence's program finishes
the output itself (no partials, no merge launch). Rows with seq_len 0 (padding) produce
zeros.

With `rope` tables given, q and the step's K arrive unrotated and the kernels rotate them
at position seq_len - 1 as they load them (neox, fp32 math, cast back as the rotary kernel
does): a decode layer launches no rotary kernel of its own.

The query heads of one KV head go through tensor cores together (the group padded to 16
rows), so K and V are read once per KV head. With `k_new`/`v_new` given, the step's own
K/V is stored here too (by split 0, at the slot its block table gives position
seq_len - 1) and the split holding that position folds it in from registers after its
loop over cached keys, not from the cache: no separate store kernel and no ordering between
programs. Padding rows store nothing. A split with no keys stores nothing either; the merge
derives the same split bounds from `seq_lens` and skips it.

Cascade: when every sequence of the batch starts with the same physical blocks (a shared
system prompt under prefix caching), `shared_len` [1] says how many keys that prefix holds.
Another kernel, launched first, then attends ROWS (sequence, query head) rows of a KV head
at a time over the prefix, reading each K/V tile once for the whole batch instead of once
per sequence; the per-sequence splits start after it, and the merge (or, at one split, the
sequence's own program) folds both sets of partials. With splits to merge, the two kernels
run side by side on two streams (two branches of a captured graph). The
prefix's length is read on the device, so one captured graph serves 0 (no prefix: the
cascade's programs exit at once) and any other length.

An FP8 cache's V tiles are widened to float16 as loaded and meet P V's dot as float16
(`_values`); K's meet q (in float16) in the dot's operand layout.

Over 500 lines: decode (its splits, merge and the cascade's prefix kernel) and prefill
share their tile loads, bounds, rotary and block-table indexing here; apart, each would
repeat them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raygraph.model.triton_ops import INTERPRETED, TL_DTYPES, rows_out, to_cache
from raygraph.model.triton_pdl import await_inputs, launch_next, pdl

TILE = 64
# verify chunks: rows a program attends for at most, and its warps (a tile of up to 32
# query rows)
CHUNK_ROWS, CHUNK_WARPS = 8, 4
PREFIX_ROWS = 64  # (sequence, query head) rows a cascade program attends over the prefix
PREFIX_WARPS = 4  # ptxas, sm_90: 64 rows spill at 2 warps (56 B of stack), not at 4


@triton.jit
def _decode_split_kernel(
    q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, verify_ptr, shared_ptr, ml_ptr,
    acc_ptr,
    out_ptr, cos_ptr, sin_ptr, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_kb, stride_ks, stride_ch, stride_bt, stride_ot, stride_oh, stride_c,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr, STORE: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
    CASCADE: tl.constexpr, TOTAL: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
    ROPE: tl.constexpr, VERIFY: tl.constexpr, CHUNKS: tl.constexpr, CH: tl.constexpr,
    CR: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr,
):
    launch_next(PDL)
    if CHUNKS:
        await_inputs(PDL)
        _chunk_rows(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, verify_ptr,
                    out_ptr, cos_ptr, sin_ptr, scale, tl.program_id(0), tl.program_id(1),
                    tl.arange(0, D), stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_kb, stride_ks, stride_ch, stride_bt, stride_ot,
                    stride_oh, stride_c, GROUP, D, BS, TILE, PRECISION, STAGES, ROPE, CH, CR)
        return
    shared = 0
    if CASCADE:
        shared = tl.load(shared_ptr)
    ahead = 0
    if VERIFY:
        ahead = tl.load(verify_ptr + tl.program_id(0)).to(tl.int32)
    _seq_split(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, ml_ptr, acc_ptr,
               out_ptr, cos_ptr, sin_ptr, scale, tl.program_id(0), tl.program_id(1),
               tl.program_id(2), shared, ahead, tl.arange(0, D), stride_qt, stride_qh, stride_kt,
               stride_kh, stride_vt, stride_vh, stride_kb, stride_ks, stride_ch, stride_bt,
               stride_ot, stride_oh, stride_c, GROUP, GROUP_PAD, D, BS, TILE, SPLITS,
               NUM_HEADS, STORE, WINDOW, PRECISION, STAGES, CASCADE, TOTAL, PREFIX_SPLITS,
               ROPE, PEEL, PDL)


@triton.jit(do_not_specialize=["num_seqs"])
def _decode_prefix_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, shared_ptr, ml_ptr, acc_ptr, cos_ptr, sin_ptr,
    scale, num_seqs, stride_qt, stride_qh, stride_kb, stride_ks, stride_ch, stride_c,
    GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, TOTAL: tl.constexpr,
    NUM_HEADS: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr,
    STAGES: tl.constexpr, ROPE: tl.constexpr,
):
    """The cascade: programs (row block, KV head, prefix split); a kernel of its own, so its
    wider tiles do not raise the per-sequence kernel's registers. It runs before the
    per-sequence kernel, which at one split merges these partials itself."""
    _prefix_split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, ml_ptr, acc_ptr, cos_ptr, sin_ptr,
                  scale, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                  tl.load(shared_ptr), num_seqs, tl.arange(0, D), stride_qt, stride_qh,
                  stride_kb, stride_ks, stride_ch, stride_c, GROUP, D, BS, TILE, SPLITS,
                  PREFIX_SPLITS, TOTAL, NUM_HEADS, ROWS, PRECISION, STAGES, ROPE)


@triton.jit
def _load_rotated(ptr, row_off, mask, pos, cos_ptr, sin_ptr, stride_c, d, D: tl.constexpr,
                  ROPE: tl.constexpr):
    """Rows at ptr + row_off, columns d (both broadcast to the rows' shape): as stored, or
    rotated neox-style at positions `pos`, in fp32 and cast back as the rotary kernel does."""
    x = tl.load(ptr + row_off + d, mask=mask, other=0.0)
    if ROPE:
        partner = tl.load(ptr + row_off + (d + D // 2) % D, mask=mask, other=0.0)
        partner = partner.to(tl.float32)
        at = pos * stride_c + d % (D // 2)
        cos = tl.load(cos_ptr + at)
        sin = tl.load(sin_ptr + at)
        x = (x.to(tl.float32) * cos + tl.where(d < D // 2, -partner, partner) * sin).to(x.dtype)
    return x


@triton.jit
def _first_key(seq_len, shared, WINDOW: tl.constexpr, CASCADE: tl.constexpr):
    """The first key the per-sequence splits cover: the window's first key, or the one
    after the shared prefix (which the cascade programs cover)."""
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    elif CASCADE:
        first = tl.minimum(shared, seq_len)
    return first


@triton.jit
def _split_range(first, end, split, SPLITS: tl.constexpr, TILE: tl.constexpr):
    """Keys [start, stop) of one split of [first, end) (a vector of splits in the merge):
    whole tiles from `first`."""
    per_split = tl.cdiv(tl.cdiv(end - first, SPLITS), TILE) * TILE
    start = first + split * per_split
    return start, tl.minimum(start + per_split, end)


@triton.constexpr_function
def _dot_dtype(q_dtype, cache_dtype):
    """The dtype q and K/V meet in: an FP8 cache is read back as float16 (one conversion an
    element pair; to bfloat16 it takes three), other caches in q's dtype."""
    return tl.float16 if cache_dtype == tl.float8e4nv else q_dtype


@triton.jit
def _dot_q(q, k_ptr):
    """q as it meets K (`_dot_dtype`), clamped to float16's range where it is float16."""
    dtype: tl.constexpr = _dot_dtype(q.dtype, k_ptr.dtype.element_ty)
    if dtype != q.dtype:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(dtype)
    return q


@triton.jit
def _kv_tile(k_ptr, v_ptr, table_ptr, pos0, end, kvh, d, stride_kb, stride_ks, stride_ch,
             dtype: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr):
    """Keys [pos0, pos0 + TILE) below `end` of one block table: K and V [TILE, D] in
    `dtype` (the dot's), and the keys' mask."""
    pos = pos0 + tl.arange(0, TILE)
    kmask = pos < end
    blk = tl.load(table_ptr + pos // BS, mask=kmask, other=0).to(tl.int64)
    off = blk[:, None] * stride_kb + (pos % BS)[:, None] * stride_ks + kvh * stride_ch \
        + d[None, :]
    k = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0).to(dtype)
    v = _values(tl.load(v_ptr + off, mask=kmask[:, None], other=0.0), dtype)
    return k, v, kmask


@triton.jit
def _fold_tile(q, m, l_sum, acc, k, v, kmask, scale, PRECISION: tl.constexpr):
    """One K/V tile (at least one key unmasked) into the online softmax of the rows of q."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, TILE]
    scores = tl.where(kmask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_sum, acc


@triton.jit
def _attend(q, m, l_sum, acc, k_ptr, v_ptr, table_ptr, scale, start, end, kvh, d,
            stride_kb, stride_ks, stride_ch, BS: tl.constexpr, TILE: tl.constexpr,
            PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """Keys [start, end) of one block table into the online softmax of the rows of q (as
    `_dot_q` gives it)."""
    for pos0 in tl.range(start, end, TILE, num_stages=STAGES):
        k, v, kmask = _kv_tile(k_ptr, v_ptr, table_ptr, pos0, end, kvh, d, stride_kb,
                               stride_ks, stride_ch, q.dtype, BS, TILE)
        m, l_sum, acc = _fold_tile(q, m, l_sum, acc, k, v, kmask, scale, PRECISION)
    return m, l_sum, acc


@triton.jit
def _values(v, dtype: tl.constexpr):
    """A V tile in `dtype`. An e4m3 tile is widened to float16 as loaded (four values a
    register, one conversion a pair), then meets P V's dot through shared memory as float16
    (`ldmatrix.trans`). A plain cast would be moved to after the dot's operand layout, where
    each thread gathers V's pairs of keys from shared memory a byte at a time; the asm is
    marked impure so that it stays where it is."""
    if (v.dtype == tl.float8e4nv) and (dtype == tl.float16) and not INTERPRETED:
        w = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
            "cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r", [v], dtype=tl.float16, is_pure=False,
            pack=4)
    else:
        w = v.to(dtype)
    return w


@triton.jit
def _store_partials(ml_ptr, acc_ptr, row, m, l_sum, acc, mask, d, D: tl.constexpr):
    # partials: ml [B, Hq, TOTAL, 2], acc [B, Hq, TOTAL, D]; row = (b, head, split) flat
    tl.store(ml_ptr + row * 2, m, mask=mask)
    tl.store(ml_ptr + row * 2 + 1, l_sum, mask=mask)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=mask[:, None])


@triton.jit
def _new_key(kn_ptr, vn_ptr, k_ptr, v_ptr, row, kvh, pos, cos_ptr, sin_ptr, stride_kt,
             stride_kh, stride_vt, stride_vh, stride_c, d, D: tl.constexpr, ROPE: tl.constexpr):
    """Row `row`'s new K (rotated at `pos`) and V of KV head kvh, as the cache stores them:
    a key attends as the cache will hold it."""
    k = _load_rotated(kn_ptr, row * stride_kt + kvh * stride_kh, d < D, pos, cos_ptr, sin_ptr,
                      stride_c, d, D, ROPE)
    v = tl.load(vn_ptr + row * stride_vt + kvh * stride_vh + d)
    return to_cache(k, k_ptr), to_cache(v, v_ptr)


@triton.jit
def _store_key(k_ptr, v_ptr, table_ptr, pos, kvh, d, k, v, stride_kb, stride_ks, stride_ch,
               BS: tl.constexpr):
    """K and V of KV head kvh into the slot the block table row gives position `pos`."""
    blk = tl.load(table_ptr + pos // BS).to(tl.int64)
    off = blk * stride_kb + (pos % BS) * stride_ks + kvh * stride_ch + d
    tl.store(k_ptr + off, k)
    tl.store(v_ptr + off, v)


@triton.jit
def _fold_key(q, k, v, m, l_sum, acc, scale, visible):
    """One key and value into the online softmax of the rows of q that see it (`visible`,
    a row mask or True): a rank-1 update. A row that has seen no key yet stays empty."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe)
    alpha = tl.exp(m - m_safe)
    return m_new, l_sum * alpha + p, acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]


@triton.jit
def _chunk_rows(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, verify_ptr,
                out_ptr, cos_ptr, sin_ptr, scale, b, kvh, d, stride_qt, stride_qh, stride_kt,
                stride_kh, stride_vt, stride_vh, stride_kb, stride_ks, stride_ch, stride_bt,
                stride_ot, stride_oh, stride_c, GROUP: tl.constexpr, D: tl.constexpr,
                BS: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                STAGES: tl.constexpr, ROPE: tl.constexpr, CH: tl.constexpr, CR: tl.constexpr):
    """One split, verify chunks read once: every row stores its own K/V; the last row of
    each CH rows of a chunk (or the chunk's last row) attends for those rows together, their
    queries in one tile of CR rows (CH rows x the KV head's query heads), over the cached
    keys once and then the chunk's keys of this step from its rows' K/V, each seen by the
    rows at and after it. The other rows write no output. A plain decode row is a chunk of
    one; a padding row (kv length 0) attends to nothing and writes zeros."""
    seq_len = tl.load(lens_ptr + b)
    last = seq_len - 1
    pos = tl.maximum(last, 0)
    ahead = tl.load(verify_ptr + b).to(tl.int32)
    k_last, v_last = _new_key(kn_ptr, vn_ptr, k_ptr, v_ptr, b, kvh, pos, cos_ptr, sin_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh, stride_c, d, D, ROPE)
    if seq_len > 0:  # NOTE: padding rows (seq_len 0) write nothing
        _store_key(k_ptr, v_ptr, tables_ptr + b * stride_bt, last, kvh, d, k_last, v_last,
                   stride_kb, stride_ks, stride_ch, BS)
    nxt = tl.load(verify_ptr + b + 1, mask=b + 1 < tl.num_programs(0), other=0)
    if (nxt == 0) | ((ahead + 1) % CH == 0):
        gp: tl.constexpr = CR // CH
        r = tl.arange(0, CR)
        i = ahead - ahead % CH + r // gp  # the query row's place in its chunk
        g = r % gp
        valid = (i <= ahead) & (g < GROUP)
        base = last - ahead  # the chunk's first key of this step
        qpos = tl.where(i <= ahead, base + i, pos)
        qpos = tl.maximum(qpos, 0)
        rows = b - ahead + tl.minimum(i, ahead)
        heads = kvh * GROUP + tl.minimum(g, GROUP - 1)
        q = _load_rotated(q_ptr, rows[:, None] * stride_qt + heads[:, None] * stride_qh,
                          valid[:, None], qpos[:, None], cos_ptr, sin_ptr, stride_c,
                          d[None, :], D, ROPE)  # [CR, D]
        m = tl.full([CR], float("-inf"), tl.float32)
        l_sum = tl.zeros([CR], tl.float32)
        acc = tl.zeros([CR, D], tl.float32)
        m, l_sum, acc = _attend(_dot_q(q, k_ptr), m, l_sum, acc, k_ptr, v_ptr,
                                tables_ptr + b * stride_bt, scale, 0, base, kvh, d, stride_kb,
                                stride_ks, stride_ch, BS, TILE, PRECISION, STAGES)
        for j in tl.range(0, ahead + 1):
            k_j, v_j = _new_key(kn_ptr, vn_ptr, k_ptr, v_ptr, b - ahead + j, kvh,
                                tl.maximum(base + j, 0), cos_ptr, sin_ptr, stride_kt,
                                stride_kh, stride_vt, stride_vh, stride_c, d, D, ROPE)
            m, l_sum, acc = _fold_key(q, k_j, v_j, m, l_sum, acc, scale,
                                      (i >= j) & (seq_len > 0))
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 rows_out(out, out_ptr, q_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _seq_split(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, ml_ptr, acc_ptr,
               out_ptr, cos_ptr, sin_ptr, scale, b, kvh, split, shared, ahead, d, stride_qt,
               stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kb, stride_ks,
               stride_ch, stride_bt, stride_ot, stride_oh, stride_c,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
               BS: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
               NUM_HEADS: tl.constexpr, STORE: tl.constexpr, WINDOW: tl.constexpr,
               PRECISION: tl.constexpr, STAGES: tl.constexpr, CASCADE: tl.constexpr,
               TOTAL: tl.constexpr, PREFIX_SPLITS: tl.constexpr, ROPE: tl.constexpr,
               PEEL: tl.constexpr, PDL: tl.constexpr):
    """One split of one sequence's own keys (after any shared prefix); split 0 stores the
    step's K/V. At one split the program writes the output: its own keys merged with the
    cascade's partials, which the prefix kernel stored before this launch. `ahead` > 0: the
    row verifies a draft, and the `ahead` rows before it hold the same sequence's earlier
    tokens of this step, whose keys (positions last - ahead .. last - 1) their own programs
    are storing now: they are folded in from those rows' K/V, never read from the cache.
    PEEL (with PDL, and in the interpreter, whose tests run this path): the split's first
    tile of cached keys, stored by earlier steps, loads before the wait, off the chain of
    kernels before; at one token and a few hundred keys it is the split's only tile."""
    seq_len = tl.load(lens_ptr + b)
    last = seq_len - 1
    pos = tl.maximum(last, 0)  # the query's position (a padding row's output is zeros)
    start, end = _split_range(_first_key(seq_len, shared, WINDOW, CASCADE), seq_len, split,
                              SPLITS, TILE)
    cached_end = end
    if STORE:  # this step's keys are folded in after the loop, from registers
        cached_end = tl.minimum(end, last - ahead)
    table_ptr = tables_ptr + b * stride_bt
    dot_dtype: tl.constexpr = _dot_dtype(q_ptr.dtype.element_ty, k_ptr.dtype.element_ty)
    if PEEL:  # cached keys were stored by earlier steps: the first tile loads before the wait
        k0, v0, mask0 = _kv_tile(k_ptr, v_ptr, table_ptr, start, cached_end, kvh, d, stride_kb,
                                 stride_ks, stride_ch, dot_dtype, BS, TILE)
    await_inputs(PDL)
    k_last = tl.zeros([D], tl.float32)
    v_last = k_last
    if STORE:
        k_last, v_last = _new_key(kn_ptr, vn_ptr, k_ptr, v_ptr, b, kvh, pos, cos_ptr, sin_ptr,
                                  stride_kt, stride_kh, stride_vt, stride_vh, stride_c, d, D,
                                  ROPE)
        if (split == 0) & (seq_len > 0):  # NOTE: padding rows (seq_len 0) write nothing
            _store_key(k_ptr, v_ptr, table_ptr, last, kvh, d, k_last, v_last, stride_kb,
                       stride_ks, stride_ch, BS)
    g = tl.arange(0, GROUP_PAD)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    if start < end:  # NOTE: an empty split stores nothing; the merge skips it the same way
        q = _load_rotated(q_ptr, b * stride_qt + heads[:, None] * stride_qh, gmask[:, None],
                          pos, cos_ptr, sin_ptr, stride_c, d[None, :], D, ROPE)  # [G, D]
        qd = _dot_q(q, k_ptr)
        first = start
        if PEEL:
            if start < cached_end:
                m, l_sum, acc = _fold_tile(qd, m, l_sum, acc, k0, v0, mask0, scale, PRECISION)
            first = start + TILE
        m, l_sum, acc = _attend(qd, m, l_sum, acc, k_ptr, v_ptr, table_ptr, scale, first,
                                cached_end, kvh, d, stride_kb, stride_ks, stride_ch, BS, TILE,
                                PRECISION, STAGES)
        if STORE:
            for j in tl.range(0, ahead):  # the verify chunk's earlier tokens
                at = last - ahead + j
                if (at >= start) & (at < end):
                    k_j, v_j = _new_key(kn_ptr, vn_ptr, k_ptr, v_ptr, b - ahead + j, kvh, at,
                                        cos_ptr, sin_ptr, stride_kt, stride_kh, stride_vt,
                                        stride_vh, stride_c, d, D, ROPE)
                    m, l_sum, acc = _fold_key(q, k_j, v_j, m, l_sum, acc, scale, True)
            if last < end:  # NOTE: a merge of the tile's path with k_last inside the loop
                # cost ~50% of the kernel (a layout conversion every tile); one rank-1 update
                m, l_sum, acc = _fold_key(q, k_last, v_last, m, l_sum, acc, scale, True)
        if SPLITS > 1:
            _store_partials(ml_ptr, acc_ptr, (b * NUM_HEADS + heads) * TOTAL + split, m,
                            l_sum, acc, gmask, d, D)
    if SPLITS == 1:
        if CASCADE:  # fold in the prefix's partials (none for a padding row)
            rows = (b * NUM_HEADS + heads) * TOTAL + SPLITS
            for p in tl.range(0, PREFIX_SPLITS):
                p_start, p_end = _split_range(0, shared, p, PREFIX_SPLITS, TILE)
                if (p_start < p_end) & (seq_len > 0):
                    m_p = tl.load(ml_ptr + (rows + p) * 2, mask=gmask, other=float("-inf"))
                    l_p = tl.load(ml_ptr + (rows + p) * 2 + 1, mask=gmask, other=0.0)
                    acc_p = tl.load(acc_ptr + (rows + p)[:, None] * D + d[None, :],
                                    mask=gmask[:, None], other=0.0)
                    m_new = tl.maximum(m, m_p)
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp(m - m_safe)
                    beta = tl.exp(m_p - m_safe)
                    l_sum = l_sum * alpha + l_p * beta
                    acc = acc * alpha[:, None] + acc_p * beta[:, None]
                    m = m_new
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 rows_out(out, out_ptr, q_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _prefix_split(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, ml_ptr, acc_ptr, cos_ptr,
                  sin_ptr, scale, rb, kvh, split, shared, num_seqs, d, stride_qt, stride_qh,
                  stride_kb, stride_ks, stride_ch, stride_c, GROUP: tl.constexpr,
                  D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                  PREFIX_SPLITS: tl.constexpr, TOTAL: tl.constexpr, NUM_HEADS: tl.constexpr,
                  ROWS: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
                  ROPE: tl.constexpr):
    """One split of the shared prefix for ROWS (sequence, query head) rows of one KV head:
    each K/V tile is read once for all of them. The prefix's blocks are every row's first
    blocks, so sequence 0's table is read. Partials go after the sequences' own splits."""
    start, end = _split_range(0, shared, split, PREFIX_SPLITS, TILE)
    if start < end:
        r = rb * ROWS + tl.arange(0, ROWS)
        seq = r // GROUP
        heads = kvh * GROUP + r % GROUP
        rmask = seq < num_seqs
        pos = tl.maximum(tl.load(lens_ptr + seq, mask=rmask, other=1) - 1, 0)
        q = _load_rotated(q_ptr, seq[:, None] * stride_qt + heads[:, None] * stride_qh,
                          rmask[:, None], pos[:, None], cos_ptr, sin_ptr, stride_c, d[None, :],
                          D, ROPE)  # [ROWS, D]
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        m, l_sum, acc = _attend(_dot_q(q, k_ptr), m, l_sum, acc, k_ptr, v_ptr, tables_ptr,
                                scale, start, end, kvh, d, stride_kb, stride_ks, stride_ch, BS,
                                TILE, PRECISION, STAGES)
        _store_partials(ml_ptr, acc_ptr, (seq * NUM_HEADS + heads) * TOTAL + SPLITS + split,
                        m, l_sum, acc, rmask, d, D)


@triton.jit
def _decode_merge_kernel(ml_ptr, acc_ptr, out_ptr, lens_ptr, shared_ptr, stride_ot, stride_oh,
                         D: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                         TILE: tl.constexpr, WINDOW: tl.constexpr, CASCADE: tl.constexpr,
                         PREFIX_SPLITS: tl.constexpr, TOTAL: tl.constexpr, ACT: tl.constexpr,
                         PDL: tl.constexpr):
    launch_next(PDL)
    await_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, TOTAL)  # the sequence's own splits, then (cascade) the prefix's
    d = tl.arange(0, D)
    seq_len = tl.load(lens_ptr + b)
    shared = 0
    if CASCADE:
        shared = tl.load(shared_ptr)
    start, end = _split_range(_first_key(seq_len, shared, WINDOW, CASCADE), seq_len, s % SPLITS,
                              SPLITS, TILE)
    if CASCADE:  # lanes SPLITS.. are the prefix's splits; a padding row has none
        p_start, p_end = _split_range(0, shared, s - SPLITS, PREFIX_SPLITS, TILE)
        own = s < SPLITS
        start = tl.where(own, start, p_start)
        end = tl.where(own, end, tl.where((seq_len > 0) & (s < SPLITS + PREFIX_SPLITS), p_end,
                                          p_start))
    used = start < end  # the splits that stored partials (none for a padding row: zeros)
    row = (b * NUM_HEADS + h) * TOTAL + s
    m = tl.load(ml_ptr + row * 2, mask=used, other=float("-inf"))
    l_sum = tl.load(ml_ptr + row * 2 + 1, mask=used, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l_sum > 0, tl.exp(m - m_max), 0.0)
    total = tl.sum(l_sum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, rows_out(out, out_ptr, ACT))


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The cascade's second stream on `device` (one a device, made on first use)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


DecodeTiles = tuple[int, int, int]  # keys per tile, warps, pipeline stages
DECODE_TILES: DecodeTiles = (TILE, 2, 3)  # bench.decode_profile --attention, H200
# an FP8 cache's tiles are half the bytes: two more stages keep as many in flight
# (bench/RESULTS.md, "FP8 served": the FP8 cache's own tiles)
DECODE_TILES_FP8: DecodeTiles = (TILE, 2, 5)


def decode_tiles(head_dim: int, fp8: bool = False) -> DecodeTiles:
    """Head sizes up to 128: DECODE_TILES (an FP8 cache: DECODE_TILES_FP8), measured at 64
    and 128 (no spill on sm_90 up to 128). Wider: 32 keys at 4 warps, since at DECODE_TILES
    a 256-wide head spills (ptxas: 255 registers and 280 B of stack a thread; (32, 4, 3):
    141, none). Not yet timed."""
    if head_dim > 128:
        return (32, 4, 3)
    return DECODE_TILES_FP8 if fp8 else DECODE_TILES


FILL_PROGRAMS = 256  # about two split programs per SM of an H100: small batches split finer
# large batches split less: programs past ~1024 (8 an SM) mostly find no keys in a wide table
# and cost launch slots. On an H200 at a 4096-key table, 2 splits beat 16 at 64-256
# sequences (e.g. 256 x 128: 33.1 vs 48.2 us; 64 x 1152: 45.8 vs 49.7)
MAX_PROGRAMS, MIN_SPLITS = 1024, 2
# from this many pairs a plain decode batch takes one split: no partials, no merge launch
# (H200, rotary inside, us a call: 64 x 128 10.6 vs 13.4 at 2 splits, 256 x 512 82.9 vs
# 89.2, 64 x 1152 level). Not with the cascade: there one split measured level in the
# kernel alone (22.3 vs 22.1) and slower served (TPOT 1.39-1.49 vs 1.36-1.37 ms)
ONE_SPLIT_PAIRS = 512


def num_splits(max_tokens: int, num_seqs: int, num_kv_heads: int, tile: int = TILE,
               cascade: bool = False) -> int:
    """Splits per sequence, from the block-table width and the batch (both static per graph
    bucket): at least 4 tiles a split up to 16 splits, and more (down to one tile a split)
    when the batch's (sequence, KV head) pairs alone leave most SMs idle; fewer when the
    pairs alone pass MAX_PROGRAMS, and one from ONE_SPLIT_PAIRS without the cascade."""
    pairs = max(1, num_seqs * num_kv_heads)
    if pairs >= ONE_SPLIT_PAIRS and not cascade:
        return 1
    by_length = max(1, min(16, triton.next_power_of_2(-(-max_tokens // (4 * tile)))))
    fill = triton.next_power_of_2(-(-FILL_PROGRAMS // pairs))
    splits = max(by_length, min(fill, triton.next_power_of_2(-(-max_tokens // tile))))
    return min(splits, max(MIN_SPLITS, triton.next_power_of_2(-(-MAX_PROGRAMS // pairs))))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None, window: int = 0, tiles: DecodeTiles | None = None,
    splits: int | None = None, shared_len: torch.Tensor | None = None,
    prefix_splits: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    verify_row: torch.Tensor | None = None, out: torch.Tensor | None = None,
    half: bool = False,
) -> torch.Tensor:
    """One query token per sequence; with k_new/v_new [B, Hkv, D], stores them first.
    Sequence b's query is row b of q, which may have more rows (a mixed step's: the rows
    past B are left as they are in `out`; rows of sequences of length 0 come out zero).
    verify_row [B] (with k_new): a row's place in its sequence's verify chunk, whose tokens
    are consecutive rows here, each at its own position (0: a plain decode row).
    window > 0: the query sees only its sequence's last `window` keys. shared_len [1] int32:
    keys at the start of every real row's table that are the same blocks in every row, all
    before each row's newest key (0: none); cascade programs attend over them once for the
    batch (not with a window). rope: the (cos, sin) tables [max_pos, D/2]; q and k_new are
    then unrotated and are rotated here, at position seq_len - 1. half (no `out`): the
    result in float16 rows standing for q's (fp8_rows.STANDS_FOR). `tiles`, `splits` and
    `prefix_splits` override the defaults (the bench's sweep)."""
    # q: [B+, Hq, D]; k_cache: [num_blocks, BS, Hkv, D]; block_tables: [B, max_blocks]
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    tile, warps, stages = tiles or decode_tiles(head_dim, k_cache.dtype == torch.float8_e4m3fn)
    cascade = shared_len is not None and window == 0
    splits = splits or num_splits(block_tables.shape[1] * block_size, num_seqs, num_kv_heads,
                                  tile, cascade)
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two (the merge's lanes), got {splits}")
    row_blocks = -(-num_seqs * group // PREFIX_ROWS)
    # the prefix's splits fill the GPU on their own (not tied to the sequences' splits,
    # which large batches keep few); partials: the sequences' splits, then the prefix's
    p_splits = (prefix_splits or triton.next_power_of_2(
        -(-FILL_PROGRAMS // (row_blocks * num_kv_heads)))) if cascade else 0
    total = triton.next_power_of_2(splits + p_splits)
    partials = splits > 1 or cascade
    ml = torch.empty(num_seqs if partials else 1, num_heads, total, 2, dtype=torch.float32,
                     device=q.device)
    acc = torch.empty(num_seqs if partials else 1, num_heads, total, head_dim,
                      dtype=torch.float32, device=q.device)
    if half and out is not None:
        raise ValueError("half: the kernel makes its float16 rows; no `out` with it")
    if out is None:
        out = torch.empty_like(q, dtype=torch.float16 if half else q.dtype)
    store = k_new is not None
    kn, vn = (k_new, v_new) if store else (q, q)
    if k_cache.stride(1) != k_cache.shape[2] * head_dim or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must be contiguous and alike")
    cos, sin = rope if rope is not None else (seq_lens, seq_lens)  # (not read without rope)
    if rope is not None and (cos.stride(0) != sin.stride(0) or cos.stride(1) != 1
                             or cos.shape[1] * 2 != head_dim):
        raise ValueError("rotary tables must be [max_pos, head_dim / 2], alike")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    shared = shared_len if cascade else seq_lens  # (not read without the cascade)
    # the prefix programs and the sequences' splits are independent until the merge: on a
    # GPU they run side by side on two streams (in a graph: two branches). At one split
    # the sequences' programs merge the prefix's partials, so it runs first, on this stream
    side = _side_stream(q.device) if cascade and splits > 1 and q.is_cuda else None
    main = torch.cuda.current_stream(q.device) if side is not None else None
    if side is not None:
        side.wait_stream(main)
    if cascade:
        with torch.cuda.stream(side):  # None: this stream
            _decode_prefix_kernel[(row_blocks, num_kv_heads, p_splits)](
                q, k_cache, v_cache, block_tables, seq_lens, shared_len, ml, acc, cos, sin,
                scale, num_seqs, q.stride(0), q.stride(1), k_cache.stride(0),
                k_cache.stride(1), k_cache.stride(2), cos.stride(0), GROUP=group, D=head_dim,
                BS=block_size, TILE=tile, SPLITS=splits, PREFIX_SPLITS=p_splits, TOTAL=total,
                NUM_HEADS=num_heads, ROWS=PREFIX_ROWS, PRECISION=precision, STAGES=stages,
                ROPE=rope is not None, num_warps=PREFIX_WARPS,
            )
    # the cascade's kernels (two streams) keep plain stream order
    launch = pdl(q, num_seqs, allowed=not cascade and q.shape[0] == num_seqs)
    verify = store and verify_row is not None
    # one split, no cascade or window: each chunk's rows attend in one program
    chunks = verify and splits == 1 and not cascade and window == 0
    gp = triton.next_power_of_2(group)
    ch = max(1, min(CHUNK_ROWS, 32 // gp))
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, kn, vn, k_cache, v_cache, block_tables, seq_lens,
        verify_row if verify else seq_lens, shared, ml, acc, out, cos, sin,
        scale, q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0),
        vn.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), cos.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=head_dim,
        BS=block_size, TILE=tile, SPLITS=splits, NUM_HEADS=num_heads, STORE=store, WINDOW=window,
        PRECISION=precision, STAGES=stages, CASCADE=cascade, TOTAL=total,
        PREFIX_SPLITS=p_splits, ROPE=rope is not None, VERIFY=verify, CHUNKS=chunks, CH=ch,
        CR=max(16, ch * gp), PEEL=launch["PDL"] or INTERPRETED,
        num_warps=CHUNK_WARPS if chunks else warps, **launch,
    )
    if side is not None:
        main.wait_stream(side)
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            ml, acc, out, seq_lens, shared, out.stride(0), out.stride(1), D=head_dim,
            SPLITS=splits, NUM_HEADS=num_heads, TILE=tile, WINDOW=window, CASCADE=cascade,
            PREFIX_SPLITS=p_splits, TOTAL=total, ACT=TL_DTYPES[q.dtype], num_warps=1, **launch,
        )
    return out


# ---- prefill: packed queries of any lengths over the paged cache --------------------------


@triton.jit
def _prefill_tile(q, acc, m, l_sum, n0, k_ptr, v_ptr, tables_ptr, b, kvh, qpos, end, d, dmask,
                  scale_log2, stride_kb, stride_ks, stride_kh, stride_bt, BS: tl.constexpr,
                  BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr,
                  EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys into the online softmax; MASK=False: every key is visible to every
    query row (tiles wholly below the causal diagonal)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASK:
        kmask = pos < end
        blk = tl.load(tables_ptr + b * stride_bt + pos // BS, mask=kmask, other=0)
    else:
        blk = tl.load(tables_ptr + b * stride_bt + pos // BS)
    off = blk.to(tl.int64)[:, None] * stride_kb + (pos % BS)[:, None] * stride_ks \
        + kvh * stride_kh + d[None, :]
    if MASK:
        k = tl.load(k_ptr + off, mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_ptr + off, mask=kmask[:, None] & dmask[None, :], other=0.0)
    elif EVEN_D:  # no mask at all: the loads vectorise
        k = tl.load(k_ptr + off)  # [BLOCK_N, D_PAD]
        v = tl.load(v_ptr + off)
    else:
        k = tl.load(k_ptr + off, mask=dmask[None, :], other=0.0)
        v = tl.load(v_ptr + off, mask=dmask[None, :], other=0.0)
    k, v = k.to(q.dtype), _values(v, q.dtype)  # the queries' dtype (float16 over FP8)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASK:
        seen = kmask[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW > 0:
            seen = seen & (pos[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    if MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    else:  # every key visible: every row's maximum is finite
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_sum


@triton.jit
def _zero_padding_rows(out_ptr, starts_ptr, num_seqs, num_tokens, z, kvh, stride_ot, stride_oh,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, ZERO_BLOCKS: tl.constexpr):
    """Zeros for the padding rows (past the last sequence's queries) among this program's
    ZERO_BLOCKS x BLOCK_Q rows: no separate fill of the whole output."""
    pad_start = tl.load(starts_ptr + num_seqs)
    z0 = z * ZERO_BLOCKS * BLOCK_Q
    if z0 + ZERO_BLOCKS * BLOCK_Q > pad_start:
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        g = rows % GROUP_PAD
        d = tl.arange(0, D_PAD)
        zeros = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], out_ptr.dtype.element_ty)
        for i in range(ZERO_BLOCKS):
            t = z0 + i * BLOCK_Q + rows // GROUP_PAD
            mask = (t >= pad_start) & (t < num_tokens) & (g < GROUP)
            tl.store(out_ptr + t[:, None] * stride_ot + (kvh * GROUP + g)[:, None] * stride_oh
                     + d[None, :], zeros, mask=mask[:, None] & (d < D)[None, :])


@triton.jit(do_not_specialize=["num_seqs", "attn_programs"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr, num_seqs, num_tokens,
    attn_programs, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks,
    stride_kh, stride_bt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, ZERO_BLOCKS: tl.constexpr, PRECISION: tl.constexpr,
    SKIP_ONE: tl.constexpr,
):
    kvh = tl.program_id(0)
    if tl.program_id(1) >= attn_programs:
        _zero_padding_rows(out_ptr, starts_ptr, num_seqs, num_tokens,
                           tl.program_id(1) - attn_programs, kvh, stride_ot, stride_oh, GROUP,
                           GROUP_PAD, BLOCK_Q, D, D_PAD, ZERO_BLOCKS)
    else:
        _prefill_block(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr,
                       num_seqs, attn_programs - 1 - tl.program_id(1), kvh, scale_log2,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks,
                       stride_kh, stride_bt, GROUP, GROUP_PAD, BLOCK_Q, D, D_PAD, BS, BLOCK_N,
                       WINDOW, PRECISION, SKIP_ONE)


@triton.jit
def _prefill_block(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr, num_seqs, pid, kvh,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_bt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, SKIP_ONE: tl.constexpr,
):
    """One block of BLOCK_Q query positions x the KV head's query heads. Blocks are taken
    last first (pid counts down): a causal sequence's heaviest blocks, whose queries see
    every key, start in the first wave, not the tail. SKIP_ONE: a leading one-token
    sequence (its token at row b) is left to the decode kernel (ops.decode_rows)."""
    # the sequence of this query block: the last b with starts[b] // BLOCK_Q + b <= pid
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(starts_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(starts_ptr + b)
    q_len = tl.load(starts_ptr + b + 1) - q_start
    if SKIP_ONE:
        q_len = tl.where((q_start == b) & (q_len == 1), 0, q_len)
    q0 = (pid - q_start // BLOCK_Q - b) * BLOCK_Q
    if q0 < q_len:
        kv_len = tl.load(lens_ptr + b)
        prefix = kv_len - q_len  # the chunk's queries sit at positions prefix..kv_len-1
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        qi = q0 + rows // GROUP_PAD
        g = rows % GROUP_PAD
        d = tl.arange(0, D_PAD)
        dmask = d < D
        rmask = (qi < q_len) & (g < GROUP)
        qpos = prefix + qi
        q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt
                    + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        if k_ptr.dtype.element_ty == tl.float8e4nv:
            # e4m3 widens to float16 in one conversion an element pair (to bfloat16 in
            # three); q meets it there, clamped to float16's range
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        end = tl.minimum(kv_len, prefix + q0 + BLOCK_Q)  # past the block's last query
        if WINDOW > 0:  # every tile masked: the window's lower edge crosses them
            start = tl.maximum(0, prefix + q0 - WINDOW + 1) // BLOCK_N * BLOCK_N
            diag = start
        else:  # keys up to the block's first query are visible to all its rows
            start = 0
            diag = (prefix + q0 + 1) // BLOCK_N * BLOCK_N
        m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
        for n0 in range(start, diag, BLOCK_N):
            acc, m, l_sum = _prefill_tile(q, acc, m, l_sum, n0, k_ptr, v_ptr, tables_ptr, b,
                                          kvh, qpos, end, d, dmask, scale_log2, stride_kb,
                                          stride_ks, stride_kh, stride_bt, BS, BLOCK_N, WINDOW,
                                          False, D == D_PAD, PRECISION)
        for n0 in range(diag, end, BLOCK_N):
            acc, m, l_sum = _prefill_tile(q, acc, m, l_sum, n0, k_ptr, v_ptr, tables_ptr, b,
                                          kvh, qpos, end, d, dmask, scale_log2, stride_kb,
                                          stride_ks, stride_kh, stride_bt, BS, BLOCK_N, WINDOW,
                                          True, D == D_PAD, PRECISION)
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot
                 + (kvh * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


PrefillTiles = tuple[int, int, int, int]  # query rows, keys per tile, warps, stages
ZERO_BLOCKS = 8  # query blocks of padding rows one program zeroes


def prefill_tiles(head_dim: int) -> PrefillTiles:
    """Query rows (positions x the KV head's query heads) per program, keys per tile, warps,
    pipeline stages. Head size 64: the fastest of 54 configs on an H200 (`bench.prefill
    --sweep`, bench/RESULTS.md); wider heads: more warps, then fewer keys (registers),
    not swept."""
    if head_dim <= 64:
        return 64, 64, 4, 2
    if head_dim <= 128:
        return 128, 64, 8, 2
    return 64, 32, 8, 2


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, window: int = 0,
    out: torch.Tensor | None = None, tiles: PrefillTiles | None = None,
    skip_one: bool = False,
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' paged keys (prefix and the
    chunk itself, already stored): prefill, chunked prefill and mixed steps alike.
    `skip_one`: the leading one-token sequences' rows are left as they are in `out` (the
    decode kernel wrote them: ops.decode_rows).

    q: [T, Hq, D], the sequences' queries back to back, then padding rows (written as zeros);
    query_start: [B + 1] int32, sequence b's queries are rows query_start[b]..[b+1] and sit at
    the last positions of its seq_lens[b] keys; padding sequences are empty. Every bound is
    read on the device, so the launch depends only on T and B: a captured graph serves every
    composition of its bucket. window > 0: each query sees only its last `window` keys.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if k_cache.stride(1) != num_kv_heads * head_dim or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must be contiguous and alike")
    if out is None:
        out = torch.empty_like(q)
    rows, block_n, warps, stages = tiles or prefill_tiles(head_dim)
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, rows // group_pad)
    num_seqs = block_tables.shape[0]
    # each sequence's query blocks start at a block of their own: at most T / BLOCK_Q + B;
    # then the programs that zero the padding rows, ZERO_BLOCKS query blocks each
    attn_programs = num_tokens // block_q + min(num_seqs, num_tokens)
    zero_programs = -(-num_tokens // (ZERO_BLOCKS * block_q))
    # KV heads vary fastest: the heads of one query block run side by side
    _prefill_kernel[(num_kv_heads, attn_programs + zero_programs)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start, num_seqs, num_tokens,
        attn_programs, scale * 1.4426950408889634,  # exp2: scores in log2 units
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BS=block_size, BLOCK_N=block_n, WINDOW=window,
        ZERO_BLOCKS=ZERO_BLOCKS, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SKIP_ONE=skip_one, num_warps=warps, num_stages=stages,
    )
    return out
