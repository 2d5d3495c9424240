"""Speculative decoding's acceptance: which of a sequence's draft tokens the target model
keeps, and the token after them, computed on the device without a host sync.

Greedy rows keep drafts up to the first one that differs from the target's argmax and
take the target's own token there. Sampled rows use rejection sampling (Leviathan et al.
2023; Chen et al. 2023): draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at
the first rejection the token is drawn from max(0, p_i - q_i) renormalised, and after every
draft is kept, from the next position's p. The emitted tokens are then distributed exactly
as the target's own samples. A proposer without probabilities (n-gram lookup) proposes
with certainty: its q is one-hot on its draft.

Rows carry k drafts at most; `num_drafts` [S] says how many of a row's are real (the rest
are padding and never kept).
"""

from __future__ import annotations

import torch


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """target [S, k+1]: the target's argmax at each draft position and after the last;
    drafts [S, k]. Returns (kept [S], tokens [S, k+1]): row s emits tokens[s, :kept+1]
    (its kept drafts, which equal the target's tokens, then the target's next one)."""
    k = drafts.shape[1]
    real = torch.arange(k, device=drafts.device) < num_drafts.unsqueeze(1)
    same = (drafts == target[:, :k]) & real
    return same.long().cumprod(1).sum(1), target


def accept_sampled(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                   draft_probs: torch.Tensor | None, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [S, k+1, V]: the target's distribution at each draft position and after the
    last (temperature, top-k/top-p applied); drafts [S, k]; draft_probs [S, k, V] the
    proposer's distributions they were drawn from (None: one-hot, a proposer without
    probabilities). Returns (kept [S], tokens [S, k+1]) as accept_greedy."""
    s, k = drafts.shape
    rows = torch.arange(s, device=drafts.device)
    real = torch.arange(k, device=drafts.device) < num_drafts.unsqueeze(1)
    p_draft = probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [S, k]
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2))
    u = torch.rand(s, k, device=drafts.device, generator=generator)
    keep = (u * q_draft < p_draft) & real  # u < p / q, without dividing by q
    kept = keep.long().cumprod(1).sum(1)
    p_at = probs[rows, kept]  # [S, V]: where the first rejection is, or after the last draft
    rejected = kept < num_drafts  # a real draft was refused there: take it out of p
    at = kept.clamp(max=k - 1)
    if draft_probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
    else:
        q_at = draft_probs[rows, at]
    residual = torch.where(rejected.unsqueeze(1), (p_at - q_at).clamp(min=0), p_at)
    # p == q leaves nothing to reject into; such a draft was kept with probability 1
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_at)
    noise = torch.empty_like(residual).exponential_(generator=generator)
    last = (residual / noise).argmax(1)  # exponential race == a draw from residual
    tokens = torch.cat([drafts, drafts.new_zeros(s, 1)], dim=1)
    tokens[rows, kept] = last
    return kept, tokens
