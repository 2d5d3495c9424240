"""Triton paged decode attention (GPU only; imported lazily), split over the KV length.

Programs are (sequence, KV head, split); each split walks its share of the sequence's
tokens up to `seq_lens[b]`, read from device memory, so the launch shape depends only on
the batch bucket and the block-table width: one captured graph serves every batch that
fits it. A second kernel merges the splits. Rows with seq_len 0 (padding) produce zeros.

The query heads of one KV head go through tensor cores together (the group padded to 16
rows), so K and V are read once per KV head. With `k_new`/`v_new` given, the step's own
K/V is stored here too (by split 0, at the slot its block table gives position
seq_len - 1) and the split holding that position folds it in from registers after its
loop over cached keys, not from the cache: no separate store kernel and no ordering between
programs. Padding rows store nothing. A split with no keys stores nothing either; the merge
derives the same split bounds from `seq_lens` and skips it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, ml_ptr, acc_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_ks, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    TILE: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr, STORE: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    last = seq_len - 1
    d = tl.arange(0, D)
    k_last = tl.zeros([D], tl.float32)
    v_last = k_last
    if STORE:
        k_last = tl.load(kn_ptr + b * stride_kt + kvh * stride_kh + d)
        v_last = tl.load(vn_ptr + b * stride_vt + kvh * stride_vh + d)
        if (split == 0) & (seq_len > 0):  # NOTE: padding rows (seq_len 0) write nothing
            blk = tl.load(tables_ptr + b * stride_bt + last // BS).to(tl.int64)
            off = blk * stride_kb + (last % BS) * stride_ks + kvh * stride_ch + d
            tl.store(k_ptr + off, k_last)
            tl.store(v_ptr + off, v_last)
    start, end = _split_range(seq_len, split, SPLITS, TILE, WINDOW)
    if start < end:  # NOTE: an empty split stores nothing; the merge skips it the same way
        _decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, ml_ptr, acc_ptr, scale, k_last, v_last,
                      b, kvh, split, start, end, last, d, stride_qt, stride_qh, stride_kb,
                      stride_ks, stride_ch, stride_bt, GROUP, GROUP_PAD, D, BS, TILE, SPLITS,
                      NUM_HEADS, STORE, PRECISION, STAGES)


@triton.jit
def _split_range(seq_len, split, SPLITS: tl.constexpr, TILE: tl.constexpr,
                 WINDOW: tl.constexpr):
    """Keys [start, end) of one split (a vector of splits in the merge): whole tiles, the
    last WINDOW keys only when WINDOW > 0."""
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), TILE) * TILE
    start = first + split * per_split
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def _decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, ml_ptr, acc_ptr, scale, k_last, v_last,
                  b, kvh, split, start, end, last, d, stride_qt, stride_qh, stride_kb,
                  stride_ks, stride_ch, stride_bt, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  TILE: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                  STORE: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    g = tl.arange(0, GROUP_PAD)
    t = tl.arange(0, TILE)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None], other=0.0)  # [G, D]
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    cached_end = end
    if STORE:  # the newest key is folded in after the loop, from registers
        cached_end = tl.minimum(end, last)
    for pos0 in tl.range(start, cached_end, TILE, num_stages=STAGES):
        pos = pos0 + t
        kmask = pos < cached_end
        blk = tl.load(tables_ptr + b * stride_bt + pos // BS, mask=kmask, other=0).to(tl.int64)
        off = blk[:, None] * stride_kb + (pos % BS)[:, None] * stride_ks + kvh * stride_ch \
            + d[None, :]
        k = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)  # [TILE, D]
        v = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, TILE]
        scores = tl.where(kmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if STORE:
        if last < end:  # NOTE: a merge of the tile's path with k_last inside the loop cost
            # ~50% of the kernel (a layout conversion every tile); one rank-1 update here
            s_last = tl.sum(q.to(tl.float32) * k_last.to(tl.float32)[None, :], axis=1) * scale
            m_new = tl.maximum(m, s_last)
            p_last = tl.exp(s_last - m_new)
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + p_last
            acc = acc * alpha[:, None] + p_last[:, None] * v_last.to(tl.float32)[None, :]
            m = m_new
    # partials: ml [B, Hq, SPLITS, 2], acc [B, Hq, SPLITS, D]
    row = (b * NUM_HEADS + heads) * SPLITS + split
    tl.store(ml_ptr + row * 2, m, mask=gmask)
    tl.store(ml_ptr + row * 2 + 1, l_sum, mask=gmask)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_merge_kernel(ml_ptr, acc_ptr, out_ptr, lens_ptr, stride_ot, stride_oh,
                         D: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                         TILE: tl.constexpr, WINDOW: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    start, end = _split_range(tl.load(lens_ptr + b), s, SPLITS, TILE, WINDOW)
    used = start < end  # the splits that stored partials (none for a padding row: zeros)
    row = (b * NUM_HEADS + h) * SPLITS + s
    m = tl.load(ml_ptr + row * 2, mask=used, other=float("-inf"))
    l_sum = tl.load(ml_ptr + row * 2 + 1, mask=used, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(l_sum > 0, tl.exp(m - m_max), 0.0)
    total = tl.sum(l_sum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


DecodeTiles = tuple[int, int, int]  # keys per tile, warps, pipeline stages
DECODE_TILES: DecodeTiles = (TILE, 2, 3)  # bench.decode_profile --attention, H200
FILL_PROGRAMS = 256  # about two split programs per SM of an H100: small batches split finer


def num_splits(max_tokens: int, num_seqs: int, num_kv_heads: int, tile: int = TILE) -> int:
    """Splits per sequence, from the block-table width and the batch (both static per graph
    bucket): at least 4 tiles a split up to 16 splits, and more (down to one tile a split)
    when the batch's (sequence, KV head) pairs alone leave most SMs idle."""
    by_length = max(1, min(16, triton.next_power_of_2(-(-max_tokens // (4 * tile)))))
    fill = triton.next_power_of_2(-(-FILL_PROGRAMS // max(1, num_seqs * num_kv_heads)))
    return max(by_length, min(fill, triton.next_power_of_2(-(-max_tokens // tile))))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None, window: int = 0, tiles: DecodeTiles | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence; with k_new/v_new [B, Hkv, D], stores them first.
    window > 0: the query sees only its sequence's last `window` keys. `tiles` and `splits`
    override the defaults (the bench's sweep)."""
    # q: [B, Hq, D]; k_cache: [num_blocks, BS, Hkv, D]; block_tables: [B, max_blocks]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    tile, warps, stages = tiles or DECODE_TILES
    splits = splits or num_splits(block_tables.shape[1] * block_size, num_seqs, num_kv_heads,
                                  tile)
    ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32,
                      device=q.device)
    out = torch.empty_like(q)
    store = k_new is not None
    kn, vn = (k_new, v_new) if store else (q, q)
    if k_cache.stride(1) != k_cache.shape[2] * head_dim or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must be contiguous and alike")
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, kn, vn, k_cache, v_cache, block_tables, seq_lens, ml, acc, scale,
        q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=head_dim,
        BS=block_size, TILE=tile, SPLITS=splits, NUM_HEADS=num_heads, STORE=store, WINDOW=window,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", STAGES=stages, num_warps=warps,
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        ml, acc, out, seq_lens, out.stride(0), out.stride(1), D=head_dim, SPLITS=splits,
        NUM_HEADS=num_heads, TILE=tile, WINDOW=window, num_warps=1,
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
                       WINDOW, PRECISION)


@triton.jit
def _prefill_block(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr, num_seqs, pid, kvh,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_bt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    """One block of BLOCK_Q query positions x the KV head's query heads. Blocks are taken
    last first (pid counts down): a causal sequence's heaviest blocks, whose queries see
    every key, start in the first wave, not the tail."""
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
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' paged keys (prefix and the
    chunk itself, already stored): prefill, chunked prefill and mixed steps alike.

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
        num_warps=warps, num_stages=stages,
    )
    return out
