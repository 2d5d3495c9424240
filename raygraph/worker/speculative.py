"""Speculative decoding's acceptance: which of a sequence's draft tokens the target model
keeps, and the token after them, computed on the device without a host sync (the host
then reads them: `emitted`).

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

from raygraph.model import ops
from raygraph.protocol import SeqChunk
from raygraph.worker.sampler import chunk_generator, chunk_probs, sample_keyed


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


def verify_rows(chunks: list[SeqChunk]) -> list[tuple[int, int, list[int]]]:
    """(chunk index, its first logits row, its drafts) of the sampling chunks that verify
    drafts; a step's logits rows are each chunk's last token, and before it its drafts'."""
    out, row = [], 0
    for i, c in enumerate(chunks):
        if c.verify:
            out.append((i, row, c.token_ids[-c.verify:]))
        row += 1 + c.verify
    return out


def last_rows(chunks: list[SeqChunk], logits: torch.Tensor, greedy: torch.Tensor | None,
              staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(logits, greedy) of each chunk's last row, which samples as usual, and the greedy
    token of every row (the target's token at each draft and after the last). `staging`:
    int64 host room for a row a chunk, pinned on a GPU (a copy from pageable memory would
    wait for the step's forward)."""
    ends, row = [], -1
    for c in chunks:
        row += 1 + c.verify
        ends.append(row)
    targets = greedy if greedy is not None else ops.argmax(logits)
    host = staging[: len(ends)]
    host.copy_(torch.tensor(ends))
    idx = host.to(logits.device, non_blocking=True)
    return logits[idx], (greedy[idx] if greedy is not None else None), targets


def sampled_targets(chunks: list[SeqChunk], logits: torch.Tensor, targets: torch.Tensor,
                    staging: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`targets` [rows] (the greedy token at every logits row) with the rows of each sampled
    verifying chunk replaced by its rejection sampling (`accept_sampled`, the drafts
    proposed with certainty): its kept drafts, then the token drawn where the first one was
    refused or after the last. A seeded chunk's rows are drawn as its plain sampling would
    draw them (`sample_keyed`): sampling p and keeping a draft while they agree is that
    rejection sampling for a draft proposed with certainty, and its tokens are then those
    of the request without drafts. `emitted` then reads them as it reads a greedy chunk's.
    logits: [rows, vocab] in float32 or the model's dtype. `staging`: int64 host room for
    the drafts, pinned on a GPU (a copy from pageable memory would wait for the step's
    forward)."""
    picked, row = [], 0
    for c in chunks:
        if c.verify and c.temperature > 0:
            picked.append((c, row))
        row += 1 + c.verify
    if not picked:
        return targets
    targets = targets.clone()  # a graph's output: read, never written
    drafts = [t for c, _ in picked for t in c.token_ids[-c.verify:]]
    host = staging[: len(drafts)]
    host.copy_(torch.tensor(drafts))
    on_device, at = host.to(logits.device, non_blocking=True), 0
    for c, row in picked:
        n = 1 + c.verify
        if c.seed is not None:  # each position drawn as decoding without drafts draws it
            targets[row: row + n] = sample_keyed(logits[row: row + n], c, generator)
            at += c.verify
            continue
        count = torch.full((1,), c.verify, dtype=torch.long, device=logits.device)
        _, tokens = accept_sampled(chunk_probs(logits[row: row + n], c).unsqueeze(0),
                                   on_device[at: at + c.verify].unsqueeze(0), count, None,
                                   chunk_generator(c, generator, logits.device))
        targets[row: row + n] = tokens[0]
        at += c.verify
    return targets


def emitted(tokens: list[int], targets: list[int], verify: list[tuple[int, int, list[int]]]
            ) -> tuple[list[int], list[int]]:
    """A step's tokens per sampling chunk, flat, and how many each: a verifying chunk's
    kept drafts (leading ones equal to the target's greedy token there) and the target's
    token after them; any other chunk its sampled token."""
    counts = [1] * len(tokens)
    per_chunk = [[t] for t in tokens]
    for i, row, drafts in verify:
        kept = 0
        while kept < len(drafts) and drafts[kept] == targets[row + kept]:
            kept += 1
        per_chunk[i] = targets[row: row + kept + 1]
        counts[i] = kept + 1
    return [t for toks in per_chunk for t in toks], counts
