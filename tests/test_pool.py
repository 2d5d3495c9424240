"""PagePool: the page state machine, misuse errors, Pin handles, watermark hysteresis, best-fit
ranges, LRU with content priority, exhaustion, and a randomized soak against a plain model."""

from __future__ import annotations

import gc
import logging
import pickle
import random
from itertools import compress

import pytest

from raygraph.config import CacheConfig, ConfigError
from raygraph.engine.pages import KINDS, PageError, PagePool, PoolExhausted


def cached_pool(n: int, cached: int, kind: str = "kv", **marks: float) -> tuple[PagePool, list]:
    """A pool whose first `cached` allocated pages were keyed (k0, k1, ...) and unpinned."""
    pool = PagePool(n, 4, **marks)
    pages = pool.allocate(cached, kind)
    for i, p in enumerate(pages):
        pool.cache(p, ("k", i))
    pool.unpin(pages)
    return pool, pages


def test_state_machine() -> None:
    pool = PagePool(4, 16)
    [p] = pool.allocate(1, "kv", owner="req-1")
    assert pool.page_info(p)[:4] == ("pinned", "kv", 1, "req-1")
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
    assert pool.lookup("h1") is None and pool.evictions == {"kv": 1, "adapter": 0}
    [q] = pool.allocate(1)
    pool.unpin([q])  # no key: straight back to free
    assert pool.page_info(q).state == "free" and pool.num_free == 4
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
    with pytest.raises(ValueError, match="kind 'lora'"):
        pool.allocate(1, "lora")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pool.allocate_range(0)
    pool.check_invariants()


def test_same_key_keeps_the_older_page() -> None:
    pool = PagePool(4, 16)
    a, b = pool.allocate(2)
    assert pool.cache(a, "h") == a
    assert pool.cache(b, "h") == a  # b stays unkeyed
    pool.unpin([a, b])
    assert pool.page_info(a).state == "cached" and pool.page_info(b).state == "free"


def test_pin_handle() -> None:
    pool = PagePool(4, 16)
    pages = pool.allocate(2)
    with pool.pin(pages, owner="step") as h:
        assert [pool.page_info(p).refs for p in pages] == [2, 2]
    assert [pool.page_info(p).refs for p in pages] == [1, 1]
    with pytest.raises(PageError, match="released twice"):
        h.release()
    pool.free(pages)


def test_dropped_pin_is_reported_and_reclaimed(caplog: pytest.LogCaptureFixture) -> None:
    pool, pages = cached_pool(4, 2)
    with caplog.at_level(logging.WARNING, logger="raygraph.memory"):
        pool.pin(pages, owner="leaky")  # handle dropped at once
        gc.collect()
    assert pool.leaked_pins == 1 and "dropped without release" in caplog.text
    assert "leaky" in caplog.text
    assert pool.num_pinned == 2  # reclaimed at the next allocation, not inside __del__
    pool.allocate(1)
    assert pool.num_pinned == 1 and pool.num_cached == 2
    pool.check_invariants()


def test_watermark_hysteresis() -> None:
    # 100 pages, evict once more than 90 are in use, down to 70
    pool, pages = cached_pool(100, 80, high_watermark=0.9, low_watermark=0.7)
    pool.allocate(10)  # 90 in use: at the high watermark, not past it
    assert pool.evictions["kv"] == 0 and pool.num_free == 10
    pool.allocate(1)  # would be 91: evict the 21 oldest so that 70 stay in use after it
    assert pool.evictions["kv"] == 21 and pool.num_free == 30 and pool.num_cached == 59
    assert [pool.lookup(("k", i)) for i in range(21)] == [None] * 21
    assert pool.lookup(("k", 21)) == pages[21]
    pool.allocate(1)  # below the high watermark again: no eviction per allocation
    assert pool.evictions["kv"] == 21
    pool.check_invariants()


def test_on_demand_eviction_takes_only_the_shortfall() -> None:
    pool, _ = cached_pool(10, 8)  # watermarks 1.0: evict only when short
    pool.allocate(5)
    assert pool.evictions["kv"] == 3 and pool.num_free == 0 and pool.num_cached == 5


def test_lru_and_content_priority() -> None:
    pool = PagePool(6, 4)
    kv = pool.allocate(3, "kv")
    adapter = list(pool.allocate_range(3, "adapter"))
    for i, p in enumerate(adapter + kv):  # the adapter goes cold first
        pool.cache(p, i)
    pool.unpin(adapter)
    pool.unpin(kv)
    pool.retain([kv[0]])  # touch kv[0]: now the most recently used KV page
    pool.unpin([kv[0]])
    order = []
    while pool.num_cached:
        before = {p for p in adapter + kv if pool.page_info(p).state == "cached"}
        pool.evict(1)
        order += [p for p in before if pool.page_info(p).state == "free"]
    assert order == [kv[1], kv[2], kv[0], *adapter]  # all cached KV before any adapter
    assert pool.stats().evictions == {"kv": 3, "adapter": 3}


def test_best_fit_ranges_and_fragmentation() -> None:
    pool = PagePool(20, 4)
    assert pool.allocate_range(20, "kv") == range(20)
    assert pool.fragmentation == 1.0 and pool.largest_free_range == 0
    pool.free([0, 1, 2, 3, 4, 6, 7, 8, 10, 11, 12, 13])  # free runs: 5 @0, 3 @6, 4 @10
    assert pool.largest_free_range == 5 and pool.fragmentation == pytest.approx(5 / 12)
    assert pool.allocate_range(3) == range(6, 9)  # exact fit over the first that fits
    assert pool.allocate_range(4) == range(10, 14)
    assert pool.allocate_range(2) == range(0, 2)
    assert pool.fragmentation == 1.0 and pool.num_free == 3
    assert sorted(pool.allocate(3)) == [2, 3, 4]  # singles skip the stale stack entries
    pool.check_invariants()


def test_range_evicts_until_a_run_fits() -> None:
    pool = PagePool(8, 4)
    pages = pool.allocate_range(8, "kv")
    for p in pages:
        pool.cache(p, p)
    pool.unpin([0, 2, 4, 5, 6, 1])  # LRU order; 3 and 7 stay pinned
    assert pool.allocate_range(3, "adapter") == range(4, 7)  # evicting 0, 2, 4, 5, 6
    assert pool.evictions["kv"] == 5 and pool.lookup(1) == 1  # 1 was not needed
    pool.check_invariants()


def test_range_exhaustion() -> None:
    pool = PagePool(6, 4)
    for p in pool.allocate_range(6, "kv"):
        pool.cache(p, p)
    pool.unpin([0, 1, 3, 4])  # 2 and 5 stay pinned: no run of 3 can ever form
    with pytest.raises(PoolExhausted, match="largest free range 0"):
        pool.allocate_range(5)  # 4 free or cached pages: hopeless, evicts nothing
    assert pool.num_cached == 4
    with pytest.raises(PoolExhausted) as e:
        pool.allocate_range(3)  # evicts every cached page looking for a run
    assert (e.value.free, e.value.cached, e.value.pinned, e.value.largest_range) == (4, 0, 2, 2)
    assert str(e.value) == ("cannot allocate a range of 3 adapter pages (largest free range 2):"
                            " 4 free, 0 cached, 2 pinned; preempt to make room")
    pool.check_invariants()


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
    assert str(err) == ("cannot allocate 3 kv pages: 0 free, 2 cached, 8 pinned; "
                        "preempt to make room")
    assert pool.num_cached == 2  # a hopeless allocation evicts nothing
    again = pickle.loads(pickle.dumps(err))  # crosses actors intact
    assert str(again) == str(err) and again.pinned == 8


def test_stats() -> None:
    pool, _ = cached_pool(16, 4)
    pool.allocate_range(3, "adapter")
    pool.allocate(2, "kv")
    s = pool.stats()
    assert (s.free, s.cached, s.pinned) == (7, {"kv": 4, "adapter": 0}, {"kv": 2, "adapter": 3})
    assert s.free + sum(s.cached.values()) + sum(s.pinned.values()) == s.num_pages


def test_offline_pages_are_never_handed_out_and_come_online_in_order() -> None:
    pool = PagePool(100, 4, high_watermark=0.9, low_watermark=0.8)
    pages = pool.allocate(30)
    pool.unpin(pages)
    assert pool.set_online(10) == -90  # a staged wake: only pages 0-9 are mapped
    assert (pool.num_free, pool.num_pinned, pool.num_available) == (10, 0, 10)
    assert (pool._evict_below, pool._evict_to) == (1, 2)  # watermarks of the online pages
    s = pool.stats()
    assert (s.offline, s.free, s.num_pages, s.largest_free_range) == (90, 10, 100, 10)
    assert pool.page_info(50).state == "offline"
    pool.check_invariants()
    got = pool.allocate(6)
    pool.cache(got[0], "a")
    assert max(got) < 10
    with pytest.raises(PoolExhausted):
        pool.allocate(5)
    assert set(pool.allocate_range(4, "adapter")) == set(range(10)) - set(got)
    assert pool.set_online(40) == 30
    more = pool.allocate(30)
    assert sorted(more) == list(range(10, 40))  # lowest ids first, none offline
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
    lambda p: p._is_free.__setitem__(7, 0),  # a free page marked taken
    lambda p: p._stack.remove(7),  # a free page allocate() can never find
    lambda p: p._refs.__setitem__(0, 1),  # a pinned page left in the LRU
    lambda p: p._lru["kv"].popitem(),  # a cached page nobody can evict
    lambda p: p._by_key.popitem(),  # a cached page lookup() cannot find
    lambda p: setattr(p, "_num_free", 5),
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
        self.kinds = ["kv"] * n
        self.raw = [0] * n  # pins the test holds itself (not through a Pin)
        self.by_key: dict[object, int] = {}
        # oldest first, in eviction priority (spelled here, not read from the pool)
        self.lru: dict[str, list[int]] = {"kv": [], "adapter": []}
        self.free = set(range(n))

    def cached(self) -> int:
        return sum(map(len, self.lru.values()))

    def pinned(self) -> int:
        return self.n - len(self.free) - self.cached()

    def runs(self) -> list[tuple[int, int]]:
        out, start = [], None
        for p in range(self.n + 1):
            if p < self.n and p in self.free:
                start = p if start is None else start
            elif start is not None:
                out.append((start, p - start))
                start = None
        return out

    def evict_one(self) -> None:
        lru = next(lru for lru in self.lru.values() if lru)
        p = lru.pop(0)
        del self.by_key[self.keys[p]]
        self.keys[p] = None
        self.free.add(p)

    def make_room(self, n: int) -> bool:
        """False: the pool must raise PoolExhausted without evicting."""
        if len(self.free) - n >= self.evict_below:
            return True
        if len(self.free) + self.cached() < n:
            return False
        while len(self.free) < n + self.evict_to and self.cached():
            self.evict_one()
        return True

    def take(self, pages: list[int], kind: str) -> None:
        assert len(set(pages)) == len(pages) and self.free.issuperset(pages)
        for p in pages:
            self.free.discard(p)
            self.refs[p], self.raw[p], self.kinds[p] = 1, 1, kind

    def retain(self, p: int) -> None:
        if self.refs[p] == 0:
            self.lru[self.kinds[p]].remove(p)
        self.refs[p] += 1

    def unpin(self, p: int) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:
            if self.keys[p] is None:
                self.free.add(p)
            else:
                self.lru[self.kinds[p]].append(p)


def soak_step(pool: PagePool, m: Model, rng: random.Random, pins: list, seen: dict) -> None:
    load = m.pinned() / m.n  # unpins and frees follow it: the pool swings around half pinned
    op = rng.choices(["alloc", "range", "hit", "share", "pin", "release", "cache", "unpin",
                      "free", "evict", "misuse"],
                     [20, 4, 6, 3, 4, 5, 14, 100 * load, 20 * load, 1, 3])[0]
    pinned = [p for p in range(m.n) if m.raw[p]]
    if op in ("alloc", "range"):
        n, kind = rng.randint(0 if op == "alloc" else 1, 5), rng.choice(KINDS)
        ok = m.make_room(n)
        if ok and op == "range":
            while not any(length >= n for _, length in m.runs()) and m.cached():
                m.evict_one()
            ok = any(length >= n for _, length in m.runs())
        if not ok:
            with pytest.raises(PoolExhausted) as e:
                (pool.allocate if op == "alloc" else pool.allocate_range)(n, kind)
            assert (e.value.free, e.value.cached, e.value.pinned) == (
                len(m.free), m.cached(), m.pinned())
            seen["exhausted"] += 1
            return
        if op == "alloc":
            m.take(pool.allocate(n, kind), kind)
        else:
            got = pool.allocate_range(n, kind)
            fits = [(length, start) for start, length in m.runs() if length >= n]
            best = min(length for length, _ in fits)
            assert any(length == best and start <= got[0] and got[-1] < start + length
                       for length, start in fits), f"range {got} is not a best fit"
            m.take(list(got), kind)
    elif op == "hit":
        cached = [k for k, p in m.by_key.items() if m.refs[p] == 0]
        if cached:
            key = rng.choice(cached)
            p = pool.lookup(key)
            assert p == m.by_key[key]
            pool.retain([p])
            m.retain(p)
            m.raw[p] += 1
            seen["hit"] += 1
    elif op == "share" and pinned:
        p = rng.choice(pinned)
        pool.retain([p])
        m.retain(p)
        m.raw[p] += 1
    elif op == "pin":
        cand = [p for p in range(m.n) if m.refs[p] or m.keys[p] is not None]
        pages = rng.sample(cand, min(len(cand), rng.randint(1, 3)))
        pins.append(pool.pin(pages))
        for p in pages:
            m.retain(p)
    elif op == "release" and pins:
        h = pins.pop(rng.randrange(len(pins)))
        h.release()
        for p in h.pages:
            m.unpin(p)
        if rng.random() < 0.1:
            with pytest.raises(PageError, match="released twice"):
                h.release()
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
        m.raw[p] -= 1
    elif op == "free":
        sole = [p for p in pinned if m.refs[p] == 1]
        if sole:
            p = rng.choice(sole)
            pool.free([p])
            m.refs[p] = m.raw[p] = 0
            if m.keys[p] is not None:
                del m.by_key[m.keys[p]]
                m.keys[p] = None
            m.free.add(p)
    elif op == "evict":
        k = rng.randint(1, 8)
        assert pool.evict(k) == min(k, m.cached())
        for _ in range(min(k, m.cached())):
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
    after each: refcounts, keys, LRU orders and the free set (so every page's state), and its
    own invariants (free map, stack, key index, counts add up)."""
    rng = random.Random(seed)
    pool = PagePool(n, 4, high, low)
    m = Model(n, pool._evict_below, pool._evict_to)
    pins: list = []
    seen: dict[str, int] = dict.fromkeys(
        ["alloc", "range", "hit", "share", "pin", "release", "cache", "unpin", "free", "evict",
         "misuse", "exhausted"], 0)
    pages = range(n)
    for _ in range(50_000):
        soak_step(pool, m, rng, pins, seen)
        assert pool._refs == m.refs and pool._key == m.keys
        assert [list(pool._lru[k]) for k in KINDS] == [m.lru[k] for k in KINDS]
        assert pool.num_free == len(m.free) and set(compress(pages, pool._is_free)) == m.free
        pool.check_invariants()
    for h in pins:
        h.release()
        for p in h.pages:
            m.unpin(p)
    assert pool._refs == m.raw and pool.num_pinned == sum(r > 0 for r in m.raw)
    pool.check_invariants()
    assert pool.stats().evictions["kv"] > 100 and pool.leaked_pins == 0
    assert min(seen.values()) > 50, seen  # every kind of operation really ran
