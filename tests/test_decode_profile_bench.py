"""bench/decode_profile.py's chain shares: how a replay's busy time is split among kernels
that overlap (programmatic dependent launch)."""

from __future__ import annotations

from bench.decode_profile import chain_shares


def test_chain_shares_count_overlap_once_and_idle_for_nobody():
    kernels = [(25.0, 30.0, "attn"), (0.0, 10.0, "gemv"), (8.0, 12.0, "norm"),
               (9.0, 20.0, "gemv"), (26.0, 28.0, "merge")]
    shares = chain_shares(kernels)
    # gemv 10 + the 8 past norm's end; 20-25 idle; merge ends inside attn
    assert shares == {"gemv": 18.0, "norm": 2.0, "attn": 5.0, "merge": 0.0}
    assert sum(shares.values()) == 30.0 - 5.0
