"""PagePool: the page state machine, misuse errors, watermark hysteresis, LRU order,
exhaustion, offline pages, and a randomized soak against a plain model."""

from __future__ import annotations

import pickle
import random

import pytest

from raygraph.config import CacheConfig, ConfigError
from raygraph.engine.pages import PageError, PagePool, PoolExhausted


def cached_pool(n: int, cached: int, **marks: float) -> tuple[PagePool, list]:
    """A pool whose first `cached` allocated pages were keyed (k0, k1, ...) and unpinned."""
    pool = PagePool(n, 4, **marks)
    pages = pool.allocate(cached)
    for i, p in enumerate(pages):
        pool.cache(p, ("k", i))
    pool.unpin(pages)
    return pool, pages


def test_state_machine() -> None:
    pool = PagePool(4, 16)
    [p] = pool.allocate(1, owner="req-1")
    assert pool.page_info(p)[:3] == ("pinned", 1, "req-1")
    assert pool.cache(p, "h1") == p and pool.lookup("h1") == p
    pool.unpin([p])  # keyed: cached, not free
    assert pool.page_info(p).state == "cached" and pool.num_cached == 1 and pool.num_free == 3
    assert pool.num_available == 4 and pool.num_pinned == 0
    pool.retain([pool.lookup("h1")], owner="req-2")  # a hit: pinned again, out of the LRU
    info = pool.page_info(p)
    assert (info.state, info.refs, info.owner, info.key) == ("pinned", 1, "req-2", "h1")
    assert pool.evict(5) == 0  # pinned pages are never evicted
    pool.unpin([p])
    assert pool.evict(5) == 1 and pool.page_info(p).state == "free"
    assert pool.lookup("h1") is None and pool.evictions == 1
    [q] = pool.allocate(1)
    pool.unpin([q])  # no key: straight back to free
    assert pool.page_info(q).state == "free" and pool.num_free == 4
    pool.check_invariants()


def test_allocation_order() -> None:
    pool = PagePool(8, 4)
    assert pool.allocate(3) == [0, 1, 2]  # lowest ids first from a fresh pool
    pool.free([1])
    assert pool.allocate(2) == [1, 3]  # the most recently freed page first
    pool.check_invariants()


def test_shared_pages_and_free() -> None:
    pool = PagePool(4, 16)
    a, b = pool.allocate(2)
    pool.cache(a, "x")
    pool.retain([a])  # shared by a second request
    with pytest.raises(PageError, match="pinned 2 times"):
        pool.free([a])
    pool.unpin([a])
    pool.free([a, b])  # one pin each: free, key dropped
    assert pool.num_free == 4 and pool.lookup("x") is None
    pool.check_invariants()


def test_misuse_errors() -> None:
    pool = PagePool(4, 16)
    [p] = pool.allocate(1)
    pool.free([p])
    with pytest.raises(PageError, match="double free"):
        pool.free([p])
    with pytest.raises(PageError, match=f"unpin of page {p}, which is free"):
        pool.unpin([p])
    with pytest.raises(PageError, match="pin of free page"):
        pool.retain([p])
    with pytest.raises(PageError, match="pin it first"):
        pool.cache(p, "k")
    [q] = pool.allocate(1)
    pool.cache(q, "k")
    with pytest.raises(PageError, match="already holds key"):
        pool.cache(q, "other")
    pool.unpin([q])
    with pytest.raises(PageError, match="which is cached: it has no pin"):
        pool.unpin([q])
    with pytest.raises(PageError, match="cached, not pinned"):
        pool.free([q])
    with pytest.raises(ValueError, match="cannot allocate -1 pages"):
        pool.allocate(-1)
    pool.check_invariants()


def test_same_key_keeps_the_older_page() -> None:
    pool = PagePool(4, 16)
    a, b = pool.allocate(2)
    assert pool.cache(a, "h") == a
    assert pool.cache(b, "h") == a  # b stays unkeyed
    pool.unpin([a, b])
    assert pool.page_info(a).state == "cached" and pool.page_info(b).state == "free"


def test_watermark_hysteresis() -> None:
    # 100 pages, evict once more than 90 are in use, down to 70
    pool, pages = cached_pool(100, 80, high_watermark=0.9, low_watermark=0.7)
    pool.allocate(10)  # 90 in use: at the high watermark, not past it
    assert pool.evictions == 0 and pool.num_free == 10
    pool.allocate(1)  # would be 91: evict the 21 oldest so that 70 stay in use after it
    assert pool.evictions == 21 and pool.num_free == 30 and pool.num_cached == 59
    assert [pool.lookup(("k", i)) for i in range(21)] == [None] * 21
    assert pool.lookup(("k", 21)) == pages[21]
    pool.allocate(1)  # below the high watermark again: no eviction per allocation
    assert pool.evictions == 21
    pool.check_invariants()


def test_on_demand_eviction_takes_only_the_shortfall() -> None:
    pool, _ = cached_pool(10, 8)  # watermarks 1.0: evict only when short
    pool.allocate(5)
    assert pool.evictions == 3 and pool.num_free == 0 and pool.num_cached == 5


def test_lru_order() -> None:
    pool, pages = cached_pool(6, 4)
    pool.retain([pages[0]])  # touch pages[0]: now the most recently used
    pool.unpin([pages[0]])
    order = []
    while pool.num_cached:
        before = {p for p in pages if pool.page_info(p).state == "cached"}
        pool.evict(1)
        order += [p for p in before if pool.page_info(p).state == "free"]
    assert order == [pages[1], pages[2], pages[3], pages[0]]
    assert pool.stats().evictions == 4


def test_exhaustion_carries_the_numbers() -> None:
    pool = PagePool(10, 4)
    pages = pool.allocate(10)
    pool.cache(pages[0], "a")
    pool.cache(pages[1], "b")
    pool.unpin(pages[:2])
    with pytest.raises(PoolExhausted) as e:
        pool.allocate(3)
    err = e.value
    assert (err.needed, err.free, err.cached, err.pinned) == (3, 0, 2, 8)
    assert str(err) == "cannot allocate 3 pages: 0 free, 2 cached, 8 pinned; preempt to make room"
    assert pool.num_cached == 2  # a hopeless allocation evicts nothing
    again = pickle.loads(pickle.dumps(err))  # crosses actors intact
    assert str(again) == str(err) and again.pinned == 8


def test_stats() -> None:
    pool, _ = cached_pool(16, 4)
    pool.allocate(5)
    s = pool.stats()
    assert (s.num_pages, s.free, s.cached, s.pinned, s.offline) == (16, 7, 4, 5, 0)


def test_offline_pages_are_never_handed_out_and_come_online_in_order() -> None:
    pool = PagePool(100, 4, high_watermark=0.9, low_watermark=0.8)
    pages = pool.allocate(30)
    pool.unpin(pages)
    assert pool.set_online(10) == -90  # a staged wake: only pages 0-9 are mapped
    assert (pool.num_free, pool.num_pinned, pool.num_available) == (10, 0, 10)
    assert (pool._evict_below, pool._evict_to) == (1, 2)  # watermarks of the online pages
    s = pool.stats()
    assert (s.offline, s.free, s.num_pages) == (90, 10, 100)
    assert pool.page_info(50).state == "offline"
    pool.check_invariants()
    got = pool.allocate(6)
    pool.cache(got[0], "a")
    assert max(got) < 10
    with pytest.raises(PoolExhausted):
        pool.allocate(5)
    assert set(pool.allocate(4)) == set(range(10)) - set(got)
    assert pool.set_online(40) == 30
    more = pool.allocate(30)
    assert more == list(range(10, 40))  # lowest ids first, none offline
    pool.check_invariants()
    with pytest.raises(PageError, match="page 20 is pinned: only free pages go offline"):
        pool.set_online(20)
    assert pool.num_online == 40  # refused whole
    pool.free(more)
    assert pool.set_online(20) == -20 and pool.num_free == 10
    with pytest.raises(ValueError, match="101 of 100"):
        pool.set_online(101)
    pool.set_online(100)
    assert pool.num_free == 90 and pool.stats().offline == 0
    pool.check_invariants()


def test_cache_config_watermarks() -> None:
    cfg = CacheConfig(block_size=8, high_watermark=0.8, low_watermark=0.5)
    pool = PagePool.from_config(100, cfg)
    assert (pool.page_size, pool._evict_below, pool._evict_to) == (8, 20, 50)
    assert CacheConfig().low_watermark < CacheConfig().high_watermark
    with pytest.raises(ConfigError, match="watermarks"):
        CacheConfig(high_watermark=0.5, low_watermark=0.8)
    with pytest.raises(ConfigError, match="watermarks"):
        CacheConfig(high_watermark=1.5)


@pytest.mark.parametrize("corrupt", [
    lambda p: p._stack.remove(7),  # a free page allocate() can never find
    lambda p: p._stack.append(7),  # a free page allocate() would hand out twice
    lambda p: p._stack.append(0),  # a cached page allocate() would hand out
    lambda p: p._refs.__setitem__(0, 1),  # a pinned page left in the LRU
    lambda p: p._lru.popitem(),  # a cached page nobody can evict
    lambda p: p._by_key.popitem(),  # a cached page lookup() cannot find
])
def test_invariant_check_catches_corruption(corrupt: object) -> None:
    pool, _ = cached_pool(8, 2)
    pool.check_invariants()
    corrupt(pool)  # type: ignore[operator]
    with pytest.raises(AssertionError):
        pool.check_invariants()


# -- randomized soak against a plain model --------------------------------------------------


class Model:
    """What the pool should hold, in plain dicts and lists."""

    def __init__(self, n: int, evict_below: int, evict_to: int) -> None:
        self.n, self.evict_below, self.evict_to = n, evict_below, evict_to
        self.refs = [0] * n
        self.keys: list[object] = [None] * n
        self.by_key: dict[object, int] = {}
        self.lru: list[int] = []  # the cached pages, oldest first
        self.free = set(range(n))

    def pinned(self) -> int:
        return self.n - len(self.free) - len(self.lru)

    def evict_one(self) -> None:
        p = self.lru.pop(0)
        del self.by_key[self.keys[p]]
        self.keys[p] = None
        self.free.add(p)

    def make_room(self, n: int) -> bool:
        """False: the pool must raise PoolExhausted without evicting."""
        if len(self.free) - n >= self.evict_below:
            return True
        if len(self.free) + len(self.lru) < n:
            return False
        while len(self.free) < n + self.evict_to and self.lru:
            self.evict_one()
        return True

    def take(self, pages: list[int]) -> None:
        assert len(set(pages)) == len(pages) and self.free.issuperset(pages)
        for p in pages:
            self.free.discard(p)
            self.refs[p] = 1

    def retain(self, p: int) -> None:
        if self.refs[p] == 0:
            self.lru.remove(p)
        self.refs[p] += 1

    def unpin(self, p: int) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:
            if self.keys[p] is None:
                self.free.add(p)
            else:
                self.lru.append(p)


def soak_step(pool: PagePool, m: Model, rng: random.Random, seen: dict) -> None:
    load = m.pinned() / m.n  # unpins and frees follow it: the pool swings around half pinned
    op = rng.choices(["alloc", "hit", "share", "cache", "unpin", "free", "evict", "misuse"],
                     [20, 6, 3, 14, 100 * load, 20 * load, 1, 3])[0]
    pinned = [p for p in range(m.n) if m.refs[p]]
    if op == "alloc":
        # mostly small; now and then a large one, which often exhausts the pool
        n = rng.randint(0, 5) if rng.random() < 0.9 else rng.randint(6, m.n)
        if not m.make_room(n):
            with pytest.raises(PoolExhausted) as e:
                pool.allocate(n)
            assert (e.value.free, e.value.cached, e.value.pinned) == (
                len(m.free), len(m.lru), m.pinned())
            seen["exhausted"] += 1
            return
        m.take(pool.allocate(n))
    elif op == "hit":
        cached = [k for k, p in m.by_key.items() if m.refs[p] == 0]
        if cached:
            key = rng.choice(cached)
            p = pool.lookup(key)
            assert p == m.by_key[key]
            pool.retain([p])
            m.retain(p)
            seen["hit"] += 1
    elif op == "share" and pinned:
        p = rng.choice(pinned)
        pool.retain([p])
        m.retain(p)
    elif op == "cache" and pinned:
        p = rng.choice(pinned)
        if m.keys[p] is None:
            key = rng.randrange(4 * m.n)  # collisions: an older page may hold the key
            holder = m.by_key.setdefault(key, p)
            if holder == p:
                m.keys[p] = key
            assert pool.cache(p, key) == holder
    elif op == "unpin" and pinned:
        p = rng.choice(pinned)
        pool.unpin([p])
        m.unpin(p)
    elif op == "free":
        sole = [p for p in pinned if m.refs[p] == 1]
        if sole:
            p = rng.choice(sole)
            pool.free([p])
            m.refs[p] = 0
            if m.keys[p] is not None:
                del m.by_key[m.keys[p]]
                m.keys[p] = None
            m.free.add(p)
    elif op == "evict":
        k = rng.randint(1, 8)
        assert pool.evict(k) == min(k, len(m.lru))
        for _ in range(min(k, len(m.lru))):
            m.evict_one()
    elif op == "misuse":
        unpinned = [p for p in range(m.n) if m.refs[p] == 0]
        if unpinned:
            p = rng.choice(unpinned)
            with pytest.raises(PageError):
                (pool.unpin if rng.random() < 0.5 else pool.free)([p])
            seen["misuse"] += 1
    seen[op] += 1


@pytest.mark.parametrize("n, high, low, seed", [(48, 1.0, 1.0, 0), (48, 0.8, 0.55, 1)])
def test_soak_against_model(n: int, high: float, low: float, seed: int) -> None:
    """5 * 10^4 random operations per case (10^5 in all), the pool compared with the model
    after each: refcounts, keys, the LRU order and the free set (so every page's state), and
    its own invariants (free stack, key index)."""
    rng = random.Random(seed)
    pool = PagePool(n, 4, high, low)
    m = Model(n, pool._evict_below, pool._evict_to)
    seen: dict[str, int] = dict.fromkeys(
        ["alloc", "hit", "share", "cache", "unpin", "free", "evict", "misuse", "exhausted"], 0)
    for _ in range(50_000):
        soak_step(pool, m, rng, seen)
        assert pool._refs == m.refs and pool._key == m.keys
        assert list(pool._lru) == m.lru
        assert pool.num_free == len(m.free) and set(pool._stack) == m.free
        pool.check_invariants()
    assert pool.stats().evictions > 100
    assert min(seen.values()) > 50, seen  # every kind of operation really ran
