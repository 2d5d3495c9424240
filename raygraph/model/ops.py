"""Paged attention: the one op the piecewise executor splits at.

The torch reference here runs everywhere (CPU tests, the GPU eager path) and is what the
GPU kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raygraph.model.context import (
    AttentionMetadata,
    current_forward_context,
    get_forward_context,
)
from raygraph.model.fp8_rows import (
    QUANTIZED,
    SCALED_MM_MIN_ROWS,
    act_dtype,
    halves_for,
    marked,
    quantizes_for,
    restored,
    with_quantized,
)
from raygraph.model.quant import (
    FP8,
    Fp8Layout,
    Fp8Weight,
    activations_as_quantized,
    quantize,
    quantize_with,
)

# rotary tables (cos, sin) [max_pos, D/2] that attention still has to apply to q and k
Rope = tuple[torch.Tensor, torch.Tensor] | None
# a linear layer's weight: [out, in] in the activations' dtype, or FP8 with its scales
Weight = torch.Tensor | Fp8Weight


def kernels(x: torch.Tensor) -> bool:
    """Whether x's ops run the Triton kernels: on a GPU. The one switch for the model's ops
    (lora_ops reads it too); tests also send CPU tensors through the kernels, in Triton's
    interpreter (tests/test_triton_served.py)."""
    return x.is_cuda


def _skinny(x: torch.Tensor, weight: Weight) -> bool:
    """Decode-sized GEMMs on a GPU go to the Triton skinny kernels (M <= 8 rows, an FP8
    weight's up to quant.DECODE_ROWS), read as its e4m3 bytes and scales."""
    if not kernels(x) or x.dim() != 2:
        return False
    from raygraph.model.triton_gemv import supports

    return supports(x, weight)


def _scaled_mm_applies(x: torch.Tensor, w: Fp8Weight) -> bool:
    """torch._scaled_mm with row-wise scales computes it: on a GPU, bf16 activations quantized
    by the GEMM (W8A8), one weight scale per output row, tiles of 16."""
    n, k = w.shape
    return (x.is_cuda and x.dim() == 2 and x.shape[0] >= SCALED_MM_MIN_ROWS
            and x.dtype == torch.bfloat16 and w.activations != "none"
            and w.scale.shape[1] == 1 and n % 16 == 0 and k % 16 == 0)


def quantize_activations(x: torch.Tensor, static: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x, float32 scales [T, 1]): per token, or by the static scale [1]. One Triton
    launch on a GPU instead of torch's several."""
    if kernels(x):
        from raygraph.model.triton_ops import quantize_rows

        return quantize_rows(x, static)
    if static is None:
        return quantize(x, x.shape[1])
    return quantize_with(x, static, 1), static.expand(x.shape[0], 1).contiguous()


def _fused(fn, *args, quantize: bool, **flags: bool):
    """A fused op's kernel call: where it quantizes its result for an FP8 GEMM, that GEMM
    reads only the e4m3 rows (FP8 layers take no LoRA delta), so the rows are not also
    stored in the activation dtype: their result is a stand-in (triton_ops._outputs).
    `flags`: the kernel's other switches (a norm's `half`)."""
    return fn(*args, quantize, keep=not quantize, **flags)


def _fused_norm(fn, x: torch.Tensor, *args, feeds: Fp8Layout | None) -> tuple:
    """A norm kernel's call on x: its rows also in e4m3 for an FP8 GEMM past the decode
    rows (quantizes_for), in float16 standing for x's at them (halves_for); the normed
    rows come first, marked, then the kernel's other results."""
    half = x.dim() == 2 and halves_for(x.shape[0], x.dtype, feeds, x.shape[-1])
    out, *rest, quantized = _fused(fn, x, *args, quantize=quantizes_for(x, feeds),
                                   half=half)
    return with_quantized(marked(out, half), quantized), *rest


def _block_gemm_applies(x: torch.Tensor, w: Fp8Weight) -> bool:
    """The Triton FP8 GEMM with a scale a row and group of columns on both sides computes
    it: on the kernels' device past the decode rows, a block-quantized weight whose x is
    quantized per token and group (dynamic activations), the groups its K tiles."""
    if not (w.scale.shape[1] > 1 and w.activations == "dynamic" and kernels(x)
            and x.dim() == 2 and x.shape[0] >= SCALED_MM_MIN_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and w.scale.is_contiguous()):
        return False
    from raygraph.model import triton_fp8_gemm

    return triton_fp8_gemm.supports(x.shape[0], *w.shape, w.group)


def fp8_gemm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None
             ) -> torch.Tensor | None:
    """x @ W^T (+ bias) of an FP8 weight, x quantized per token (or by the static input
    scale): through the Triton FP8 GEMM where it beats cuBLASLt (triton_fp8_gemm.preferred)
    or where the weight's scales are per block, else torch._scaled_mm; None where neither
    applies."""
    scaled_mm = _scaled_mm_applies(x, w)
    made = getattr(x, QUANTIZED, None)  # stored by the op that made x
    takes_made = (scaled_mm and made is not None and made[0].shape == x.shape
                  and w.activations == "dynamic")
    if not takes_made and x.dim() == 2 and x.numel() > 1 and x.stride() == (0, 0):
        raise RuntimeError(f"activations {tuple(x.shape)} were stored only in e4m3 (_fused), "
                           f"for a GEMM that does not take them ({tuple(w.shape)})")
    if _block_gemm_applies(x, w):
        from raygraph.model import triton_fp8_gemm

        # per token and group: each group a row of quantize_activations (one launch)
        xq, x_scale = quantize_activations(x.contiguous().view(-1, w.group), None)
        return triton_fp8_gemm.fp8_gemm(xq.view(x.shape), x_scale.view(x.shape[0], -1),
                                        w.data, w.scale, x.dtype, bias)
    if not scaled_mm:
        return None
    xq, x_scale = made if takes_made else quantize_activations(
        x, w.input_scale if w.activations == "static" else None)
    from raygraph.model import triton_fp8_gemm

    if triton_fp8_gemm.preferred(xq.shape[0], w.shape[0], w.shape[1],
                                 triton_fp8_gemm.has_tma(xq.device)):
        return triton_fp8_gemm.fp8_gemm(xq, x_scale, w.data, w.scale, x.dtype, bias)
    y = torch._scaled_mm(xq, w.data.t(), scale_a=x_scale,
                         scale_b=w.scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)


def dense_operands(x: torch.Tensor, weight: Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, W) for the GEMMs of plain weights: an FP8 weight dequantized to x's dtype, and x
    quantized and dequantized as the FP8 GEMM would see it. The reference path (CPU) and
    the GPU's for what neither _scaled_mm nor the skinny kernels take (blocks or
    weight-only past DECODE_ROWS rows)."""
    if not isinstance(weight, Fp8Weight):
        return x, weight
    assert weight.data.dtype == FP8
    return activations_as_quantized(x, weight), weight.dequantize(x.dtype)


def _skinny_operands(x: torch.Tensor, weight: Weight, shape_ok: bool
                     ) -> tuple[torch.Tensor, Weight, bool]:
    """(x, W, whether the skinny kernels take them). An FP8 weight they do not take (or any
    on the CPU) becomes dense_operands, which they may take; `shape_ok`: the fused op's own
    shape condition. x's float16 rows standing for another dtype's only go to the skinny
    kernels as they are."""
    if shape_ok and _skinny(x, weight):
        return x, weight, True
    x = restored(x)
    if not isinstance(weight, Fp8Weight):
        return x, weight, False
    x, weight = dense_operands(x, weight)
    return x, weight, shape_ok and _skinny(x, weight)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), as F.linear. Float16 rows standing for another dtype's give
    that dtype (STANDS_FOR): at their rows (decode rows) no W8A8 GEMM applies, and
    _skinny_operands converts them back for anything but the skinny kernels."""
    if isinstance(weight, Fp8Weight):
        y = fp8_gemm(x, weight, bias)
        if y is not None:
            return y
    x, weight, skinny = _skinny_operands(x, weight, True)
    if skinny:
        from raygraph.model.triton_gemv import gemv

        return gemv(x, weight, bias, act=act_dtype(x))
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: Weight, feeds: Fp8Layout | None = None
                        ) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) with weight = [gate | up] on its rows; `feeds`: the
    FP8 layout of the layer that takes the result (see rms_norm)."""
    if isinstance(weight, Fp8Weight):
        y = fp8_gemm(x, weight)
        if y is not None:
            return silu_and_mul(y, feeds)
    # tiles of 16+ columns
    x, weight, fused = _skinny_operands(x, weight, (weight.shape[0] // 2) % 16 == 0)
    if fused:
        from raygraph.model.triton_gemv import gemv_silu_mul

        half = halves_for(x.shape[0], act_dtype(x), feeds, weight.shape[0] // 2)
        return marked(gemv_silu_mul(x, weight, half=half, act=act_dtype(x)), half)
    return silu_and_mul(F.linear(x, weight))


def linear_rotary(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, positions: torch.Tensor,
    cos_table: torch.Tensor, sin_table: torch.Tensor, head_dim: int, num_q_heads: int,
    num_k_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Rope]:
    """linear(x) over [q | k | v] heads, then q and k rotated (or left for attention, see
    rotary_or_defer): q [T, Hq, D], k and v [T, Hk, D], and the rotation still owed."""
    t = x.shape[0]
    sizes = [num_q_heads * head_dim, num_k_heads * head_dim, num_k_heads * head_dim]
    qkv = fp8_gemm(x, weight, bias) if isinstance(weight, Fp8Weight) else None
    fused = False
    if qkv is None:  # the fused kernel's tiles hold whole rotation pairs
        x, weight, fused = _skinny_operands(x, weight, head_dim % 16 == 0)
    if fused:
        from raygraph.model.triton_gemv import gemv_rotary

        qkv = gemv_rotary(x, weight, bias, positions, cos_table, sin_table, head_dim,
                          num_q_heads + num_k_heads, act=act_dtype(x))
        q, k, v = qkv.split(sizes, dim=-1)
        rope = None
    else:
        qkv = F.linear(x, weight, bias) if qkv is None else qkv
        q, k, v = qkv.split(sizes, dim=-1)
        q, k, rope = rotary_or_defer(q.view(t, num_q_heads, head_dim),
                                     k.view(t, num_k_heads, head_dim), cos_table, sin_table,
                                     positions)
    return (q.view(t, num_q_heads, head_dim), k.view(t, num_k_heads, head_dim),
            v.view(t, num_k_heads, head_dim), rope)


def rotary_or_defer(
    q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, Rope]:
    """q and k rotated, and None; or, when this step's attention is the decode kernel, q and
    k as they are and the tables: the kernel rotates them as it loads them, and the layer
    launches no rotary kernel (~3 us of a batch-64 layer's ~15 us of attention on an H200)."""
    if kernels(q):
        ctx = get_forward_context()
        if ctx.split is None and ctx.attn.decode:
            return q, k, (cos_table, sin_table)
    q, k = rotary(q, k, cos_table, sin_table, positions)
    return q, k, None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the argmax of each row of [N, vocab] logits (first index on ties;
    a NaN is not taken on the GPU path)."""
    if kernels(x) and x.dim() == 2:
        from raygraph.model.triton_ops import argmax as fused

        return fused(x)
    return x.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             feeds: Fp8Layout | None = None) -> torch.Tensor:
    """RMSNorm as HF computes it: normalise in fp32, cast back, scale by the weight.
    `feeds`: the FP8 layout of the layer whose GEMM takes the result; where that GEMM
    quantizes it per token, the kernel stores it so too and the GEMM skips a launch."""
    if kernels(x):
        from raygraph.model.triton_ops import rms_norm as fused

        return _fused_norm(fused, x, weight, eps, feeds=feeds)[0]
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of q [T, Hq, D] and k [T, Hk, D] normalised with q's or k's weight (Qwen3's
    q/k norms): on a GPU both in one launch."""
    d = q.shape[2]
    if kernels(q) and q.stride()[1:] == (d, 1) and k.stride()[1:] == (d, 1):
        from raygraph.model.triton_ops import qk_rms_norm

        return qk_rms_norm(q, k, q_weight, k_weight, eps)
    t, hq = q.shape[:2]
    return (rms_norm(q.reshape(t * hq, d), q_weight, eps).view(q.shape),
            rms_norm(k.reshape(t * k.shape[1], d), k_weight, eps).view(k.shape))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    feeds: Fp8Layout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add fused into the next norm;
    `feeds` as rms_norm's."""
    if kernels(x):
        from raygraph.model.triton_ops import add_rms_norm as fused

        return _fused_norm(fused, x, residual, weight, eps, feeds=feeds)
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_and_mul(x: torch.Tensor, feeds: Fp8Layout | None = None) -> torch.Tensor:
    """SwiGLU's activation: x = [gate | up] on the last dim -> silu(gate) * up. `feeds` as
    rms_norm's."""
    if kernels(x):
        from raygraph.model.triton_ops import silu_and_mul as fused

        return with_quantized(*_fused(fused, x,
                                      quantize=quantizes_for(x, feeds, x.shape[-1] // 2)))
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q [T, Hq, D] and k [T, Hk, D]; tables [max_pos, D/2]."""
    if kernels(q):
        from raygraph.model.triton_ops import rotary_

        rotary_(q, k, cos_table, sin_table, positions)
        return q, k
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows at their slots, without a host sync (capturable).

    NOTE: padding slots are -1. The GPU kernel skips them; the torch path redirects them to
    the cache's last slot, a scratch slot the scheduler never hands out (the worker
    allocates one block more than it reports).
    """
    # k: [T, Hkv, D]; k_cache: [num_blocks + 1, block_size, Hkv, D]
    if kernels(k):
        from raygraph.model.triton_ops import store_kv as fused

        return fused(k, v, k_cache, v_cache, slot_mapping)
    scratch = k_cache.shape[0] * k_cache.shape[1] - 1
    slots = torch.where(slot_mapping >= 0, slot_mapping, scratch)
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = to_cache(x, cache.dtype)
        if cache.dtype == FP8_KV:  # index_copy_ has no float8 kernel: copy the bytes
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x)


FP8_KV = torch.float8_e4m3fn  # an FP8 KV cache's storage
FP8_KV_MAX = 448.0  # its largest finite value: a K/V entry past it saturates


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V rows in the cache's dtype (FP8: saturated at +-448, the kernels do the same)."""
    if dtype == FP8_KV:
        return x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)
    return x.to(dtype)


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
    scale: float, window: int = 0,
) -> torch.Tensor:
    """Causal attention of each query over its sequence's cached keys (prefill, chunked
    prefill and decode alike): gather blocks, pad queries per sequence, mask by position
    (window > 0: only the last `window` keys). Padding rows (past md.num_tokens) are zeros."""
    # q: [T, Hq, D] -> out: [T, Hq, D]
    n = md.num_tokens
    token_seq, token_row = md.token_seq[:n], md.token_row[:n]
    num_seqs = md.block_tables.shape[0]
    block_size = k_cache.shape[1]
    num_blocks = -(-md.max_kv_len // block_size)
    table = md.block_tables[:, :num_blocks].long()
    # [B, L, Hkv, D], read back in the queries' dtype (an FP8 cache)
    k = k_cache[table].flatten(1, 2)[:, : md.max_kv_len].to(q.dtype)
    v = v_cache[table].flatten(1, 2)[:, : md.max_kv_len].to(q.dtype)
    qp = q.new_zeros(num_seqs, md.max_q_len, *q.shape[1:])
    qp[token_seq, token_row] = q[:n]
    qpos = torch.zeros(num_seqs, md.max_q_len, dtype=torch.long, device=q.device)
    qpos[token_seq, token_row] = md.positions[:n]
    keys = torch.arange(md.max_kv_len, device=q.device)
    # zero what a sequence does not own (its last block's tail, padded table entries):
    # a masked score is still NaN when the stale K/V behind it is inf or NaN
    owned = (keys.view(1, -1) < md.seq_lens.view(-1, 1)).view(num_seqs, -1, 1, 1)
    k = torch.where(owned, k, 0)
    v = torch.where(owned, v, 0)
    mask = keys.view(1, 1, -1) <= qpos.unsqueeze(-1)  # [B, Q, L]
    if window > 0:
        mask &= keys.view(1, 1, -1) > qpos.unsqueeze(-1) - window
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True,
    )
    real = out.transpose(1, 2)[token_seq, token_row]
    if n == q.shape[0]:
        return real
    return torch.cat((real, q.new_zeros(q.shape[0] - n, *q.shape[1:])))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float, window: int = 0, rope: Rope = None,
    kv_scale: tuple[float, float] = (1.0, 1.0), feeds: Fp8Layout | None = None,
) -> torch.Tensor:
    """Store this step's K/V into the paged cache, then attend: [T, Hq * D], the rows the
    output projection takes. Reads the forward context. `rope`: q and k are not rotated yet
    (rotary_or_defer). `kv_scale` (k_scale, v_scale): the cache holds k / k_scale and
    v / v_scale (an FP8 cache's per-tensor scales), so the scores take k_scale into the
    softmax scale and the output is multiplied by v_scale. `feeds`: the output
    projection's FP8 layout; at decode rows the decode kernel then stores float16 rows
    standing for q's (fp8_rows.halves_for).

    This is the one place a piecewise executor splits: when the context carries a `split`
    hook, the hook runs attention (eagerly, between captured pieces) instead.
    """
    k_scale, v_scale = kv_scale
    if k_scale != 1.0 or v_scale != 1.0:  # rotary is linear: k may be scaled before it
        k, v, scale = k / k_scale, v / v_scale, scale * k_scale
    ctx = get_forward_context()
    t = q.shape[0]
    if ctx.split is not None:  # rope is None here: rotary_or_defer never defers under one
        out = ctx.split(q, k, v, k_cache, v_cache, scale, window)
    else:
        half = (kernels(q) and v_scale == 1.0
                and halves_for(t, q.dtype, feeds, q.shape[1] * q.shape[2]))
        out = paged_attention(q, k, v, k_cache, v_cache, scale, ctx.attn, window=window,
                              rope=rope, half=half)
    out = (out if v_scale == 1.0 else out * v_scale).reshape(t, -1)
    return marked(out, out.dtype != q.dtype)


def decode_kernel_takes(head_dim: int) -> bool:
    """Heads a power of two wide (64, 128, 256): the decode kernel's. Others (80, 96, 100)
    go through the prefill kernel, whose tiles pad the head, decode steps included (their
    input buffers then carry a decode step's query starts: InputBuffers.decode_starts)."""
    return head_dim & (head_dim - 1) == 0


def decode_rows(md: AttentionMetadata) -> torch.Tensor:
    """[B] int32: the kv length of each leading one-token sequence of a step that is not all
    decode (sequence b's one token at row b, as the scheduler puts running sequences
    first), 0 for the rest: the rows a mixed step's decode kernel takes. Made once a
    forward (a few elementwise launches) and kept on its context; the prefill kernel
    leaves the same rows (`skip_one`)."""
    ctx = current_forward_context()
    if ctx is not None and ctx.attn is md and ctx.decode_lens is not None:
        return ctx.decode_lens
    starts = md.query_start
    rows = torch.arange(starts.shape[0] - 1, device=starts.device, dtype=starts.dtype)
    lens = torch.where((starts[:-1] == rows) & (starts[1:] == rows + 1), md.seq_lens, 0)
    if ctx is not None and ctx.attn is md:
        ctx.decode_lens = lens
    return lens


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, scale: float, md: AttentionMetadata, out: torch.Tensor | None = None,
    window: int = 0, rope: Rope = None, half: bool = False,
) -> torch.Tensor:
    """Store this step's K/V, then attend: the Triton kernels on a GPU (decode: one query a
    sequence; anything else: the packed prefill kernel, no per-shape plan), the torch
    reference elsewhere. `out`, if given, receives the result; `rope`: q and k are not
    rotated yet (the decode kernel rotates them as it loads them); `half`: the decode
    kernel stores float16 rows standing for q's (other paths ignore it)."""
    if kernels(q) and md.decode and out is None and decode_kernel_takes(q.shape[-1]):
        # the decode kernel stores the new K/V itself
        from raygraph.model.triton_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale,
                                      k, v, window, shared_len=md.shared_len, rope=rope,
                                      verify_row=md.verify_row, half=half)
    if rope is not None:
        q, k = rotary(q, k, *rope, md.positions)
    store_kv(k, v, k_cache, v_cache, md.slot_mapping)
    if kernels(q):
        from raygraph.model.triton_attention import (
            paged_decode_attention,
            paged_prefill_attention,
        )

        # a mixed step: its decode rows through the decode kernel, which splits their long
        # key runs over programs (the prefill kernel would give each one query block)
        split = decode_kernel_takes(q.shape[-1])
        if split:
            out = paged_decode_attention(q, k_cache, v_cache, md.block_tables,
                                         decode_rows(md), scale, window=window, out=out)
        return paged_prefill_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                       md.query_start, scale, window, out=out, skip_one=split)
    result = paged_attention_ref(q, k_cache, v_cache, md, scale, window)
    return result if out is None else out.copy_(result)
