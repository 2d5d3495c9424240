"""Multi-LoRA deltas: y += (x A_s^T) B_s^T for each token's adapter slot s, base rows untouched.

A linear layer with LoRA holds every slot's A and B in two persistent stacked tensors
(`LoRAWeights`), so one captured graph serves any mix of adapters: loading an adapter
writes its slot in place. The torch reference here runs everywhere (CPU, and it is what the
Triton kernels of model/triton_lora.py are checked against); neither path syncs with the
host or has a data-dependent shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raygraph.model import ops
from raygraph.model.context import LoRAInputs, get_forward_context

# up to this many tokens (decode), a LoRA layer computes every slot's shrink inside its base
# GEMM; above it (prefill) that work would grow with the tokens, and the shrink kernel
# multiplies each token by its own slot's A only
EXT_MAX_TOKENS = 256


@dataclass
class LoRAWeights:
    """One linear layer's adapter slots, zero-padded to the max rank R, scaling folded into B.

    A merged layer (q|k|v, gate|up) has one A per part, stacked along the rank dim, and one B
    whose rows are the layer's output rows: part p's rows read A rows [p*R, (p+1)*R).
    A is the view of the layer's weight rows after W's (parallel.LoRARows): for a few
    tokens one GEMM over [W; every slot's A] gives y and every slot's u at once; on an H200
    that cost 0.5-1 us a decode layer where a separate shrink kernel took ~6.
    """

    a: torch.Tensor  # [max_loras, parts * R, in_local]
    b: torch.Tensor  # [max_loras, out_local, R]
    slices: tuple[int, ...]  # each part's output rows on this rank, in order
    # the parts adapters may target (LoRAConfig.targets); the others stay zero and the
    # kernels skip them. None: all
    parts: tuple[int, ...] | None = None

    @property
    def rank(self) -> int:
        return self.b.shape[2]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor,
               slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """[T, out]: for a token t of slot s >= 0, (x[t] A[s]^T) B[s]^T (per part); 0 for s = -1.
    Every slot's shrink in one GEMM, then `expand_all`."""
    # x: [T, in]; a: [L, P*R, in]; b: [L, out, R]; token_slot: [T]
    return expand_all(x @ a.reshape(-1, a.shape[2]).T, b, token_slot, slices)


def expand_all(u: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor,
               slices: tuple[int, ...] | None = None) -> torch.Tensor:
    """[T, out] from every slot's shrink u [T, L * P * R]: each token's own slot's ranks
    times its B^T, per part. Branch-free: the other slots' rows are masked to exact zeros,
    then one contraction over (slot, rank) per part."""
    num, _, r = b.shape
    slices = slices or (b.shape[1],)
    t = u.shape[0]
    hot = F.one_hot(token_slot.long().clamp(min=0), num).to(u.dtype)
    hot = hot * (token_slot >= 0).unsqueeze(1).to(u.dtype)  # [T, L]; -1 rows all zero
    u = u.reshape(t, num, len(slices), r) * hot[:, :, None, None]
    return torch.cat([torch.einsum("tlr,lor->to", u[:, :, p], part)
                      for p, part in enumerate(b.split(slices, dim=1))], dim=1)


def lora_active(w: LoRAWeights | None) -> bool:
    """Whether this step adds a delta to a layer with weights `w` (None: no LoRA on it)."""
    return w is not None and get_forward_context().lora is not None


def lora_linear(x: torch.Tensor, weight: ops.Weight, bias: torch.Tensor | None,
                w: LoRAWeights | None) -> torch.Tensor:
    """linear(x) plus each token's adapter delta (linear(x) alone when the layer has no LoRA
    or the step reads no adapter). With LoRA, `weight` holds every slot's A after W's rows
    (and is never FP8: the two are not combined).
    A few tokens: one GEMM over all of it, then the expand reads each token's own slot's u.
    More (prefill): the GEMM over W, and a shrink by each token's own slot only."""
    if w is None:
        return ops.linear(x, weight, bias)
    assert isinstance(weight, torch.Tensor)
    n = sum(w.slices)
    if not lora_active(w):
        return ops.linear(x, weight[:n], bias)
    lora: LoRAInputs = get_forward_context().lora
    if x.shape[0] > EXT_MAX_TOKENS:
        y = ops.linear(x, weight[:n], bias)
        if ops.kernels(y):
            from raygraph.model.triton_lora import add_lora_

            add_lora_(y, x, w.a, w.b, lora.order, lora.sorted_slot, w.slices, w.parts)
            return y
        return y.add_(lora_delta(x, w.a, w.b, lora.token_slot, w.slices))
    out = ops.linear(x, weight)  # [T, out + L*P*R]: y, then every slot's u
    y, u = out[:, :n], out[:, n:]
    if bias is not None:
        y.add_(bias)
    if ops.kernels(y):
        from raygraph.model.triton_lora import lora_expand_

        lora_expand_(y, u, w.b, lora.order, lora.sorted_slot, w.slices,
                     w.parts or tuple(range(len(w.slices))), slot_stride=w.a.shape[1])
        return y
    return y.add_(expand_all(u, w.b, lora.token_slot, w.slices))


def num_lora_slots(model: nn.Module) -> int:
    """The adapter slots a model was built with (0: LoRA off)."""
    return max((m.lora.a.shape[0] for m in model.modules()
                if getattr(m, "lora", None) is not None), default=0)
