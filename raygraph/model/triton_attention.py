"""Triton paged decode attention (GPU only; imported lazily).

One program per (sequence, KV head) walks that sequence's blocks up to `seq_lens[b]`, read
from device memory, so the launch shape depends only on the batch bucket: one captured
graph serves every batch that fits it. Rows with seq_len 0 (padding) produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    s = tl.arange(0, BS)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BS)):
        blk = tl.load(tables_ptr + b * stride_bt + i).to(tl.int64)
        kmask = i * BS + s < seq_len
        off = blk * stride_kb + s[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0).to(tl.float32)  # [BS, D]
        v = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BS]
        scores = tl.where(kmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    # q: [B, Hq, D]; k_cache: [num_blocks, BS, Hkv, D]; block_tables: [B, max_blocks]
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(1, triton.next_power_of_2(group)), D=head_dim,
        BS=k_cache.shape[1], num_warps=4,
    )
    return out
