"""Paged attention: the one op the piecewise executor splits at.

The torch reference here runs everywhere (CPU tests, the GPU eager path) and is what the
GPU kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raygraph.model.context import AttentionMetadata, get_forward_context


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows at their slots; slots < 0 (padding) are dropped."""
    # k: [T, Hkv, D]; k_cache: [num_blocks, block_size, Hkv, D]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query over its sequence's cached keys (prefill, chunked
    prefill and decode alike): gather blocks, pad queries per sequence, mask by position."""
    # q: [T, Hq, D] -> out: [T, Hq, D]
    num_seqs = md.block_tables.shape[0]
    block_size = k_cache.shape[1]
    num_blocks = -(-md.max_kv_len // block_size)
    table = md.block_tables[:, :num_blocks].long()
    k = k_cache[table].flatten(1, 2)[:, : md.max_kv_len]  # [B, L, Hkv, D]
    v = v_cache[table].flatten(1, 2)[:, : md.max_kv_len]
    qp = q.new_zeros(num_seqs, md.max_q_len, *q.shape[1:])
    qp[md.token_seq, md.token_row] = q
    qpos = torch.zeros(num_seqs, md.max_q_len, dtype=torch.long, device=q.device)
    qpos[md.token_seq, md.token_row] = md.positions
    keys = torch.arange(md.max_kv_len, device=q.device)
    mask = keys.view(1, 1, -1) <= qpos.unsqueeze(-1)  # [B, Q, L]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2)[md.token_seq, md.token_row]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Store this step's K/V into the paged cache, then attend. Reads the forward context."""
    md = get_forward_context().attn
    store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    return paged_attention_ref(q, k_cache, v_cache, md, scale)
