"""GPU: the sampler on the device as the served worker runs it (bf16 logits of a 128K
vocabulary, staged row parameters): its ranking shortcuts keep what a float32 sort of the
whole row keeps."""

from __future__ import annotations

import pytest
import torch

from raygraph.protocol import SeqChunk
from raygraph.worker.sampler import (
    RANKED_TOP_K,
    SamplingRows,
    _filter_top_k_top_p,
    sample_tokens,
)
from tests.test_sampler import nucleus_margin

pytestmark = pytest.mark.gpu
VOCAB = 128_256


def test_top_k_candidates_keep_what_the_whole_row_sort_keeps() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB, device="cuda") * 3
    top_k = torch.randint(1, RANKED_TOP_K + 1, (64,), device="cuda")
    top_p = torch.rand(64, device="cuda") * 0.5 + 0.5
    temperature = torch.rand(64, device="cuda") + 0.4
    whole = _filter_top_k_top_p(logits, temperature, top_k, top_p, (False, True))
    ranked = _filter_top_k_top_p(logits, temperature, top_k, top_p, (True, False))
    # rows whose nucleus bound is clear of float32 rounding (the widths' sums differ there)
    clear = nucleus_margin(logits, temperature, top_k, top_p) > 1e-4
    assert clear.sum() >= 56
    assert torch.equal(ranked[clear], whole[clear])
    # bf16 rows (as the graphs hand them back), ranked in bf16, keep their float32 copy's
    rows = logits.to(torch.bfloat16)
    assert torch.equal(_filter_top_k_top_p(rows, temperature, top_k, top_p),
                       _filter_top_k_top_p(rows.float(), temperature, top_k, top_p))


def test_staged_device_sampling_is_the_host_lists_sampling() -> None:
    """Seeded rows of every filter kind, unseeded and greedy rows, one batch: the staged
    (no host sync) call draws what the plain call draws from the same generator state."""
    logits = (torch.randn(8, VOCAB, device="cuda") * 3).to(torch.bfloat16)
    chunks = [SeqChunk(i, [0], 0, [0], True, temperature=t, top_k=k, top_p=p, seed=s,
                       num_generated=3)
              for i, (t, k, p, s) in enumerate([(0.0, 0, 1.0, None), (0.6, 0, 0.9, 1),
                                                (0.7, 50, 1.0, 2), (0.7, 20, 0.8, 3),
                                                (1.0, 0, 1.0, 4), (0.6, 0, 0.9, None),
                                                (0.0, 0, 1.0, None), (0.8, 0, 1.0, 5)])]
    staging = SamplingRows(8, logits.device)
    for trial in range(3):
        plain = sample_tokens(logits, chunks, torch.Generator("cuda").manual_seed(trial))
        staged = sample_tokens(logits, chunks, torch.Generator("cuda").manual_seed(trial),
                               staging=staging)
        assert torch.equal(plain, staged)
    greedy = logits.argmax(-1)
    assert staged[0] == greedy[0] and staged[6] == greedy[6]

