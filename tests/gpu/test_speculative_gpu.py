"""GPU: speculative decoding on the built-in model in float32, verify steps as decode rows
in the captured decode graphs: greedy tokens equal those without speculation, and seeded
sampled requests draw the same tokens again (rejection sampling on the device)."""

from __future__ import annotations

import pytest

from tests.test_speculative import served

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_greedy_tokens_with_speculation_equal_without(mode):
    plain, _ = served(False, mode, device="cuda")
    spec, sched = served(True, mode, device="cuda")
    assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain]
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens > 0


def test_sampled_requests_speculate_reproducibly():
    (first, sched), (again, _) = (served(True, temperature=0.8, device="cuda")
                                  for _ in range(2))
    assert sched.num_draft_tokens > 0
    assert all(len(s.output_token_ids) == 40 for s in first)
    assert [s.output_token_ids for s in first] == [s.output_token_ids for s in again]
