"""An EAGLE-3 draft head (Li et al. 2025) as the EAGLE authors publish it: `fc` maps three of
the target's hidden states (the residual stream entering three of its layers) to one;
`midlayer`, one decoder layer whose q|k|v read the normed token embedding beside the normed
hidden state; `norm`; `lm_head` over a smaller draft vocabulary, which `d2t` maps into the
target's (target id = draft id + d2t[draft id]); `t2d` (the reverse mask) is read and not
used. Without `embed_tokens` in the checkpoint the head reads the target's. The
`speculators` layout names the layer `layers.0.*`, nests its config.json and by default
takes the layer's residual after the hidden state's norm (`norm_before_residual`).

At position i the head takes the token at i + 1 and a hidden state for position i (the
target's, through fc, or its own from the step before) and predicts the token at i + 2.
"""

from __future__ import annotations

import torch
from torch import nn

from raygraph.config import ModelConfig
from raygraph.model import ops
from raygraph.model.llama import MLP, Attention, RMSNorm
from raygraph.model.parallel import (
    Comm,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm) -> None:
        super().__init__()
        h, d, kv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.self_attn = Attention(cfg, comm)
        # q|k|v read [embedding | hidden state]: twice the width
        self.self_attn.qkv_proj = MergedColumnParallelLinear(
            2 * h, [cfg.num_heads * d, kv, kv], comm, bias=cfg.attention_bias)
        self.mlp = MLP(cfg, comm)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = self.self_attn(positions, x)
        residual = normed if self.norm_before_residual else hidden
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    """`own_embedding` False: the checkpoint has none; whoever runs the head sets
    `embed_tokens` to the target's."""

    def __init__(self, cfg: ModelConfig, comm: Comm, own_embedding: bool = True) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens: nn.Module | None = (
            VocabParallelEmbedding(cfg.vocab_size, h, comm) if own_embedding else None)
        self.fc = RowParallelLinear(3 * h, h, comm)
        self.midlayer = Eagle3Layer(cfg, comm)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h, comm)
        self.d2t = nn.Parameter(torch.zeros(cfg.draft_vocab_size, dtype=torch.long),
                                requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output, which the head's logits read; the output before the norm,
        the hidden state of its next step) for tokens [T] and hidden states [T, hidden]."""
        out, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden)
        return self.norm(out, residual)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states [T, 3 x hidden] as one [T, hidden]."""
        return self.fc(aux)

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token, as a target token id."""
        draft = ops.argmax(self.lm_head(normed).float())
        return draft + self.d2t[draft]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn]
