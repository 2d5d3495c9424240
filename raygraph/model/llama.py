"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral), tensor-parallel.

Module and parameter names mirror HF transformers so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from raygraph.config import ModelConfig
from raygraph.model import ops
from raygraph.model.lora_ops import lora_active
from raygraph.model.parallel import (
    Comm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from raygraph.model.quant import Fp8Layout
from raygraph.model.rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
        feeds: Fp8Layout | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual). `feeds`: the FP8
        layout of the layer that takes the result (its GEMM may get it quantized here)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, feeds)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, feeds)


class RotaryEmbedding(nn.Module):
    """The neox-style rotary tables, precomputed in fp32: q|k|v's GEMM (ops.linear_rotary),
    the rotary op or, in decode, the attention kernel applies them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)  # the checkpoint's variant
        self.register_buffer("cos", cos, persistent=False)  # [max_pos, D/2]
        self.register_buffer("sin", sin, persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        tp = comm.world_size
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = cfg.kv_heads_per_rank(tp)
        self.head_dim = d
        self.scale = d**-0.5
        self.window = cfg.sliding_window
        kv = cfg.num_kv_heads * d
        kv_shards = cfg.num_kv_heads // self.num_kv_heads  # < tp: KV heads replicated
        self.qkv_proj = MergedColumnParallelLinear(h, [cfg.num_heads * d, kv, kv], comm,
                                                   bias=cfg.attention_bias,
                                                   shards=[tp, kv_shards, kv_shards])
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, comm)
        self.rotary = RotaryEmbedding(cfg)
        # Qwen3: RMSNorm over each q and k head, after the projection and before rotary
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Bound by the worker once the paged cache exists: [num_blocks + 1, block_size, Hkv, D].
        # zeros, not empty: real where the loader builds parameters on meta (it moves empty)
        self.k_cache = torch.zeros(0)
        self.v_cache = torch.zeros(0)
        # (k_scale, v_scale): an FP8 cache holds k / k_scale and v / v_scale (the worker sets
        # a checkpoint's scales when the cache is FP8)
        self.kv_scale = (1.0, 1.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v, rope = self.qkv(positions, x)
        return self.o_proj(ops.attention(q, k, v, self.k_cache, self.v_cache, self.scale,
                                         self.window, rope, self.kv_scale, self.o_proj.fp8))

    def qkv(self, positions: torch.Tensor, x: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ops.Rope]:
        """q [T, Hq, D], k and v [T, Hkv, D], q and k rotated unless the rotation is left to
        attention (`ops.rotary_or_defer`; then its tables come last). Without q/k norms or a
        LoRA delta the GEMM and rotary are one op (fused for skinny batches on a GPU); with
        them the norms or the delta must come between the two."""
        proj, cos, sin = self.qkv_proj, self.rotary.cos, self.rotary.sin
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None and not lora_active(proj.lora):
            return ops.linear_rotary(x, proj.base_weight, proj.bias, positions, cos, sin, d, hq,
                                     hk)
        t = x.shape[0]
        q, k, v = proj(x).split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.view(t, hq, d), k.view(t, hk, d)
        if self.q_norm is not None and self.k_norm is not None:
            # both norms are built with the config's rms_norm_eps
            q, k = ops.qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k, rope = ops.rotary_or_defer(q, k, cos, sin, positions)
        return q, k, v.view(t, hk, d), rope


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], comm)
        self.down_proj = RowParallelLinear(i, h, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if lora_active(self.gate_up_proj.lora):  # the delta comes before the activation
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(ops.linear_silu_and_mul(x, self.gate_up_proj.base_weight,
                                                      self.down_proj.fp8))


# layer index -> that layer's feed-forward block (MoE models swap the dense MLP for it)
MlpFactory = Callable[[int], nn.Module]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, comm)
        self.mlp = mlp if mlp is not None else MLP(cfg, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it): the residual add
        happens inside the next norm, as in HF (x = residual + sublayer(norm(residual)))."""
        qkv = self.self_attn.qkv_proj.fp8  # FP8 layouts: the layers' weights are not read here
        if residual is None:
            residual, h = x, self.input_layernorm(x, feeds=qkv)
        else:
            h, residual = self.input_layernorm(x, residual, qkv)
        h = self.self_attn(positions, h)
        gate_up = getattr(self.mlp, "gate_up_proj", None)  # a dense MLP's (not MoE's)
        h, residual = self.post_attention_layernorm(
            h, residual, gate_up.fp8 if gate_up is not None else None)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, make_mlp: MlpFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, comm, make_mlp(i) if make_mlp else None)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # an EAGLE-3 head reads the residual stream entering these layers: each forward
        # writes them side by side into the first rows of `aux` [tokens, 3 x hidden]
        self.aux_layers: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                self._keep(i, x if residual is None else x + residual)
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]

    def _keep(self, layer: int, stream: torch.Tensor) -> None:
        h = stream.shape[-1]
        for j, at in enumerate(self.aux_layers):  # a small model may name a layer twice
            if at == layer:
                self.aux[: stream.shape[0], j * h: (j + 1) * h].copy_(stream)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, make_mlp: MlpFactory | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, comm, make_mlp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of tokens."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [N, vocab] on every rank."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]
