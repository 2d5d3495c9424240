"""Speculative decoding's parts: n-gram prompt lookup (engine/ngram.py) and acceptance
(worker/speculative.py): greedy keeps exactly the target's tokens; rejection sampling
emits tokens distributed as the target's own samples (chi-square, small vocabulary)."""

from __future__ import annotations

import random

import pytest
import torch

from raygraph.engine.ngram import NgramIndex
from raygraph.worker.speculative import accept_greedy, accept_sampled


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram with an earlier occurrence (the latest one): what followed."""
    end = len(tokens) - 1
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[end - n + 1:]
        for start in range(end - n, -1, -1):  # latest earlier occurrence first
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_proposals():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 9, 5, 6, 7])
    assert index.propose(3) == [8, 9, 5]  # "5 6 7" seen at 0..2
    index.extend([1])
    assert index.propose(2) == []  # "1" never seen before
    index.extend([5, 6])
    assert index.propose(4) == [7, 1, 5, 6]  # the latest "5 6" is at 5..6
    index.extend([2, 6])
    assert index.propose(2) == [2, 6]  # only "6" matches: its latest earlier one, at 10
    assert index.propose(0) == []
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_equals_a_full_search(seed):
    rng = random.Random(seed)
    index, tokens = NgramIndex(2, 4), []
    for _ in range(300):
        chunk = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        index.extend(chunk)
        tokens += chunk
        assert index.propose(3) == brute_force(tokens, 3, 2, 4)


def test_greedy_keeps_leading_matches_only():
    target = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 2, 3, 4], [4, 5, 6, 7]])
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [9, 2, 3], [4, 5, 6]])
    kept, tokens = accept_greedy(target, drafts, torch.tensor([3, 3, 3, 1]))
    assert kept.tolist() == [3, 1, 0, 1]  # the last row proposed one draft: one at most
    emitted = [tokens[i, : n + 1].tolist() for i, n in enumerate(kept.tolist())]
    assert emitted == [[4, 5, 6, 7], [4, 9], [1], [4, 5]]


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value, 4 degrees of freedom, p = 0.001 (a 1-in-1000 false alarm)
CRITICAL_DF4 = 18.47


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_rejection_sampling_emits_the_targets_distribution(proposer):
    """V = 5, two drafts a row, the target's distribution fixed per position: the first
    emitted token follows p_0 and, where the first draft was kept, the second follows p_1,
    whatever the drafts were. 40,000 rows; an n-gram proposer (one-hot q, fixed drafts) and
    a draft model (drafts drawn from its own q)."""
    gen = torch.Generator().manual_seed(0)
    n, v = 40_000, 5
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    probs = p.expand(n, 3, v)
    if proposer == "ngram":
        drafts, q = torch.tensor([[1, 4]]).expand(n, 2).contiguous(), None
    else:
        q_rows = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
        q = q_rows.expand(n, 2, v)
        drafts = torch.stack([torch.multinomial(q_rows[i], n, replacement=True, generator=gen)
                              for i in range(2)], dim=1)
    kept, tokens = accept_sampled(probs, drafts, torch.full((n,), 2), q, gen)
    assert chi_square(tokens[:, 0], p[0]) < CRITICAL_DF4
    second = tokens[kept >= 1, 1]
    assert second.numel() > 1000 and chi_square(second, p[1]) < CRITICAL_DF4
    # a proposer that matches the target is always kept
    kept_all, _ = accept_sampled(probs, drafts, torch.full((n,), 2),
                                 p[:2].expand(n, 2, v), gen)
    assert proposer == "ngram" or bool((kept_all == 2).all())


def test_rejection_sampling_never_keeps_padding_or_impossible_drafts():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]).expand(64, 3, 3)
    drafts = torch.tensor([[1, 2]]).expand(64, 2)
    kept, tokens = accept_sampled(probs, drafts, torch.full((64,), 2), None,
                                  torch.Generator().manual_seed(1))
    assert (kept == 1).all()  # 1 is certain; 2 has probability 0 under the target
    assert set(tokens[:, 1].tolist()) <= {0, 1}  # drawn from p_1 without the refused 2
    kept, _ = accept_sampled(probs, drafts, torch.zeros(64, dtype=torch.long), None)
    assert (kept == 0).all()  # no real drafts: only the target's own token


def test_sampled_verify_rows_emit_the_targets_distribution():
    """sampled_targets, then emitted, as a worker runs them: 3,000 sampled chunks verify two
    drafts over 5 tokens at temperature 1. The first token emitted follows the target's p_0
    and, where the first draft was kept, the second follows p_1; a seeded chunk draws the
    same again; a greedy chunk beside them keeps its argmax rows."""
    from raygraph.protocol import SeqChunk
    from raygraph.worker.speculative import emitted, sampled_targets, verify_rows

    n = 3000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4], [0.2] * 5])
    chunks = [SeqChunk(i, [0, 1, 4], 10, [0], True, temperature=1.0, verify=2)
              for i in range(n)]
    chunks.append(SeqChunk(n, [0, 3, 3], 10, [0], True, verify=2))  # greedy
    logits = p.log().repeat(n + 1, 1)
    greedy = logits.argmax(-1)
    staging = torch.zeros(2 * n + 2, dtype=torch.long)
    targets = sampled_targets(chunks, logits, greedy, staging,
                              torch.Generator().manual_seed(0))
    assert torch.equal(targets[-3:], greedy[-3:]) and torch.equal(greedy, logits.argmax(-1))
    flat, counts = emitted([0] * (n + 1), targets.tolist(), verify_rows(chunks))
    per_chunk, at = [], 0
    for c in counts:
        per_chunk.append(flat[at: at + c])
        at += c
    assert per_chunk[-1] == [0]  # greedy: its first draft (3) is not the argmax
    first = torch.tensor([t[0] for t in per_chunk[:n]])
    assert chi_square(first, p[0]) < CRITICAL_DF4
    second = torch.tensor([t[1] for t in per_chunk[:n] if len(t) > 1])
    assert second.numel() > 300 and chi_square(second, p[1]) < CRITICAL_DF4
    seeded = [SeqChunk(0, [0, 1, 4], 10, [0], True, temperature=1.0, seed=7, verify=2)]
    draws = [sampled_targets(seeded, logits[:3], greedy[:3], staging, torch.Generator())
             for _ in range(2)]
    assert torch.equal(*draws)
