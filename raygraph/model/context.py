"""The per-step context the model reads: one typed object, set by a non-nesting manager."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query may attend to.

    Token t belongs to sequence `token_seq[t]` at query row `token_row[t]`; it sits at
    absolute position `positions[t]` and sees keys 0..positions[t] of its sequence. The
    first `num_tokens` rows are real; the rest of a bucket is padding.
    """

    slot_mapping: torch.Tensor  # [T] int64; NOTE: padding slots are -1, slot 0 is real
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: kv length after this step
    query_start: torch.Tensor  # [B + 1] int32: sequence b's tokens are rows [qs[b], qs[b+1])
    positions: torch.Tensor  # [T] int64
    token_seq: torch.Tensor  # [T] int64
    token_row: torch.Tensor  # [T] int64
    num_tokens: int  # host-side values: what the reference path reads (never the kernels)
    max_q_len: int
    max_kv_len: int
    decode: bool = False  # every sequence has exactly one query token
    # decode: [1] int32, keys at the start of every sequence held in the same blocks (the
    # kernel's cascade reads them once for the batch); None: the cascade is not compiled in
    shared_len: torch.Tensor | None = None
    # decode: [T] int64, each row's place in its sequence's verify chunk (a sequence that
    # verifies drafts runs one decode row per token, each at its own position; 0: a plain
    # decode row). None: no row verifies
    verify_row: torch.Tensor | None = None


@dataclass
class LoRAInputs:
    """Which adapter slot each token reads: -1 is the base model (and every padding row).

    `order` lists the tokens grouped by slot (a stable sort, made on the host) and
    `sorted_slot` their slots in that order: the GPU kernels tile over it, so a tile of
    tokens mostly reads one adapter's weights.
    """

    token_slot: torch.Tensor  # [T] int32
    order: torch.Tensor  # [T] int32: a permutation of the rows
    sorted_slot: torch.Tensor  # [T] int32: token_slot[order]


# (q, k, v, k_cache, v_cache, scale, window) -> attention output; set by a piecewise executor
SplitHook = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int],
    torch.Tensor,
]


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    split: SplitHook | None = None
    # MoE expert parallelism: every rank of the EP group pads its tokens to this many before
    # dispatch (the largest batch in the DP group, bucketed); 0 = no padding (no EP).
    num_comm_tokens: int = 0
    # multi-LoRA: each token's adapter slot; None: no token reads one (or LoRA is off)
    lora: LoRAInputs | None = None
    # a mixed step: the kv lengths of the rows the decode kernel takes (ops.decode_rows),
    # made by the first attention layer of this forward and read by the rest
    decode_lens: torch.Tensor | None = None


_CONTEXT: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """The single channel for per-step metadata; refuses nesting and always clears."""
    global _CONTEXT
    if _CONTEXT is not None:
        raise RuntimeError("forward_context is already set; nesting is a bug")
    _CONTEXT = ctx
    try:
        yield ctx
    finally:
        _CONTEXT = None


def current_forward_context() -> ForwardContext | None:
    """The forward's context, or None outside one (a piecewise graph's eager attention)."""
    return _CONTEXT


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("model called outside forward_context()")
    return _CONTEXT
