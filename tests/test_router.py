"""The router's choices (coordinator/router.py): a prompt follows its longest cached prefix within
the load bound, otherwise the less loaded of two; round-robin; replicas that are down are
skipped; the prefix map stays bounded."""

from __future__ import annotations

import random

import pytest

from raygraph.config import ConfigError, ReplicaConfig
from raygraph.coordinator.router import Router, prefix_hashes

BLOCK = 4


def router(replicas: int = 2, spill_at: int = 64, **kw) -> Router:
    return Router(replicas, ReplicaConfig(replicas=replicas, **kw), BLOCK, spill_at,
                  random.Random(0))


def test_prefix_hashes_are_chained_over_full_blocks_only():
    a = prefix_hashes(list(range(10)), BLOCK)
    assert len(a) == 2  # 10 tokens: two full blocks of 4
    b = prefix_hashes(list(range(8)) + [99, 98, 97, 96], BLOCK)
    assert b[:2] == a and len(b) == 3
    c = prefix_hashes([7] + list(range(1, 10)), BLOCK)
    assert c[0] != a[0] and c[1] != a[1]  # an early difference changes every later entry
    packed = prefix_hashes(bytes(4 * 8), BLOCK)  # uint32 ids: 4 bytes a token
    assert len(packed) == 2


def test_a_shared_prefix_goes_where_it_went_before():
    r = router(4)
    system = list(range(100, 164))
    first = r.pick(system + [1, 2, 3, 4], cost=10)
    for i in range(20):
        r.done(first, 10)
        assert r.pick(system + [i] * 8, cost=10) == first
    assert r.hits == 20


def test_the_load_bound_overrides_the_prefix_and_the_home_stays():
    r = router(2, max_imbalance=1.5, balance_tokens=250)
    system = list(range(64))
    last = prefix_hashes(system, BLOCK)[-1]
    home = r.pick(system, cost=100)
    assert r.pick(system, cost=100) == home  # 200 against 0: more than 1.5x, not 250 more
    assert r.pick(system, cost=100) == 1 - home  # 300: both bounds passed: an overflow
    assert r.hits == 1
    assert r.prefixes[last] == home  # an overflow does not move the prefix's home
    r.done(home, 200)
    assert r.pick(system, cost=100) == home and r.hits == 2


def test_load_routing_spreads_unrelated_prompts_evenly():
    r = router(4, routing="load")
    for i in range(400):
        r.pick([i] * 16, cost=1)
    assert max(r.load) - min(r.load) <= 20  # power of two choices: nearly even


def test_round_robin_cycles_and_skips_replicas_that_are_down():
    r = router(3, routing="round-robin")
    assert [r.pick([1], 1) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r.set_up(1, False)
    assert {r.pick([1], 1) for _ in range(4)} == {0, 2}
    r.set_up(0, False)
    r.set_up(2, False)
    with pytest.raises(ValueError, match="no replica is serving"):
        r.pick([1], 1)


def test_a_prefix_on_a_replica_that_is_down_is_not_followed():
    r = router(2)
    system = list(range(32))
    home = r.pick(system, cost=1)
    r.set_up(home, False)
    assert r.pick(system, cost=1) == 1 - home
    assert r.prefixes[prefix_hashes(system, BLOCK)[-1]] == 1 - home  # a new home
    r.set_up(home, True)
    assert r.pick(system, cost=1) == 1 - home


def test_the_prefix_map_is_bounded_and_done_releases_load():
    r = router(2, max_prefixes=10)
    for i in range(50):
        replica = r.pick([i] * 16, cost=5)
        r.done(replica, 5)
    assert len(r.prefixes) == 10
    assert r.load == [0, 0]


def test_replica_config_refuses_nonsense():
    with pytest.raises(ConfigError, match="replicas must be >= 1"):
        ReplicaConfig(replicas=0)
    with pytest.raises(ConfigError, match="max_imbalance"):
        ReplicaConfig(max_imbalance=0.5)


def shared_prefix_load(r: Router, n: int, prompts: int, seed: int) -> list[int]:
    """n requests, each one of `prompts` system prompts at random plus its own part, each
    finished before the next (no outstanding load): tokens routed per replica."""
    rng = random.Random(seed)
    systems = [[p] * 64 for p in range(prompts)]
    routed = [0] * len(r.load)
    for i in range(n):
        replica = r.pick(systems[rng.randrange(prompts)] + [1000 + i] * 8, cost=72)
        routed[replica] += 72
        r.done(replica, 72)
    return routed


@pytest.mark.parametrize("seed", range(5))
def test_homes_are_rebalanced_by_traffic_with_few_moves(seed: int):
    """16 prompts drawn at random give two replicas unequal traffic when each prompt keeps
    the replica it first went to; moving a few prefixes evens it out and keeps the hits."""
    fixed = shared_prefix_load(router(2, rebalance_gap=1e9), 2000, 16, seed)
    r = router(2)
    balanced = shared_prefix_load(r, 2000, 16, seed)
    assert max(balanced) / min(balanced) - 1 <= 0.1
    assert r.hits >= 0.95 * 2000 and 0 < r.moves <= 60  # a move: one recomputed prefix
    assert max(fixed) / min(fixed) - 1 > max(balanced) / min(balanced) - 1


def test_a_move_takes_the_whole_prefix_and_the_traffic_table_stays_bounded():
    r = router(2, max_prefixes=64)
    r.routed = [1000.0, 0.0]  # replica 0 was routed far more
    system = list(range(32))
    r.prefixes.update(dict.fromkeys(prefix_hashes(system, BLOCK), 0))
    assert r.pick(system + [7] * 4, cost=8) == 1 and r.moves == 1
    assert set(r.prefixes[h] for h in prefix_hashes(system + [7] * 4, BLOCK)) == {1}
    shared_prefix_load(r, 500, 40, 0)
    assert len(r.prefixes) <= 64 and set(r.traffic) <= set(r.prefixes)


def test_rebalance_gap_must_be_positive():
    with pytest.raises(ConfigError, match="rebalance_gap"):
        ReplicaConfig(rebalance_gap=0)


def test_elastic_replicas_take_requests_only_while_the_awake_ones_are_full():
    r = router(3, spill_at=2, min_replicas=1, routing="load")
    picks = [r.pick([i] * 8, cost=1) for i in range(2)]
    assert picks == [0, 0]  # replica 0 has room for its batch
    spilled = {r.pick([9] * 8, cost=1) for _ in range(4)}
    assert spilled <= {0, 1, 2} and spilled & {1, 2}  # full: elastic replicas take some
    for replica in range(3):
        for _ in range(r.requests[replica]):
            r.done(replica, 1)
    assert r.requests == [0, 0, 0] and r.pick([5] * 8, cost=1) == 0  # room again: awake only
    r.set_up(0, False)  # the only awake replica is down: the elastic ones serve
    assert r.pick([5] * 8, cost=1) in (1, 2)


def test_min_replicas_is_bounded_by_replicas():
    with pytest.raises(ConfigError, match="min_replicas"):
        ReplicaConfig(replicas=2, min_replicas=3)
    assert ReplicaConfig(replicas=3).awake == 3
    assert ReplicaConfig(replicas=3, min_replicas=0).awake == 0


def test_an_adapters_requests_go_where_it_went_before_and_share_prefixes_only_with_it():
    r = router(4)
    short = [1, 2]  # under a block: only the adapter gives it a home
    homes = {name: r.pick(short, cost=10, adapter=name) for name in ("a", "b", "c")}
    for i in range(12):
        for name, home in homes.items():
            r.done(home, 10)
            assert r.pick(short + [i], cost=10, adapter=name) == home
    system = list(range(100, 132))
    base = prefix_hashes(system, BLOCK)
    with_a = prefix_hashes(system, BLOCK, "a")
    assert len(with_a) == len(base) + 1 and not set(with_a) & set(base)  # no shared prefix
    assert with_a[0] == prefix_hashes([], BLOCK, "a")[0] != prefix_hashes([], BLOCK, "b")[0]
    assert prefix_hashes(system, BLOCK, None) == base  # the base model's prompts as before
