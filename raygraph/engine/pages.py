"""One pool of fixed-size pages for every kind of content: KV blocks and adapter weights.

Pure Python bookkeeping (no torch): the scheduler owns one, workers only see page ids. A page
is free, pinned (refcount > 0: a request or a step uses it) or cached (refcount 0, but its
content, named by a key, is kept for reuse until evicted):

    free --allocate--> pinned --last unpin--> cached (page has a key) | free (no key)
    cached --retain / pin (a lookup hit)--> pinned        cached --evict--> free

Pages [num_online, num_pages) are offline: neither free nor cached, never handed out, and
left out of the watermarks and of usage. A staged wake (memory/kv_arena.py) maps the KV
cache's first blocks first: the pool offers only those, and set_online() adds the rest in
page order as the workers map them.

Cached pages are evicted LRU, cached KV before warm adapters, in batches between two
watermarks (see CacheConfig). Single pages cost O(1): free pages are a stack (the most
recently freed page goes out first) over a byte map of which pages are free; contiguous
ranges (adapters) are best fit over the map's runs, found by bytes.find (C speed). Pages a
range takes stay in the stack as stale entries, skipped when popped.

NOTE: not thread-safe (one owner drives it). PageError means a caller bug and is raised
before the offending page changes, but pages earlier in the same call stay changed.
"""

from __future__ import annotations

import logging
import operator
import re
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from itertools import compress, repeat
from typing import TYPE_CHECKING, Literal, NamedTuple

import msgspec

if TYPE_CHECKING:
    from raygraph.config import CacheConfig

log = logging.getLogger("raygraph.memory")

Kind = Literal["kv", "adapter"]
KINDS: tuple[Kind, ...] = ("kv", "adapter")  # eviction priority: cached KV goes first
_FREE_RUN = re.compile(b"\x01+")


class PageError(RuntimeError):
    """A page used against its state: double free, unpin without a pin, a Pin released twice."""


class PoolExhausted(RuntimeError):
    """Too few pages even with every cached page evicted: the scheduler preempts and retries."""

    def __init__(self, needed: int, free: int, cached: int, pinned: int, kind: str = "kv",
                 largest_range: int | None = None) -> None:
        super().__init__(needed, free, cached, pinned, kind, largest_range)  # picklable
        self.needed, self.free, self.cached, self.pinned = needed, free, cached, pinned
        self.kind, self.largest_range = kind, largest_range

    def __str__(self) -> str:
        what = f"{self.needed} {self.kind} pages"
        if self.largest_range is not None:
            what = f"a range of {what} (largest free range {self.largest_range})"
        return (f"cannot allocate {what}: {self.free} free, {self.cached} cached, "
                f"{self.pinned} pinned; preempt to make room")


class PageInfo(NamedTuple):
    state: str  # free | cached | pinned | offline
    kind: Kind  # meaningless while free
    refs: int
    owner: object
    key: Hashable | None
    last_access: int  # the pool's operation counter at the last pin or unpin, not wall time


class PoolStats(msgspec.Struct, frozen=True):
    """Page counts per (state, kind) and eviction counters, for metrics."""

    num_pages: int
    free: int
    cached: dict[str, int]
    pinned: dict[str, int]
    evictions: dict[str, int]
    leaked_pins: int
    largest_free_range: int
    fragmentation: float  # largest free range / free pages: 1.0 is one run (or none free)
    offline: int = 0  # pages past num_online (a staged wake has not mapped them yet)


class Pin:
    """Pins on `pages`, held until release() or the end of a `with`. A Pin dropped unreleased
    is a bug in its holder: it is logged and counted, and its pins are reclaimed at the
    pool's next allocation, so pages cannot stay pinned forever."""

    __slots__ = ("pages", "owner", "_pool", "_held")

    def __init__(self, pool: PagePool, pages: Sequence[int], owner: object) -> None:
        self.pages, self.owner, self._pool, self._held = pages, owner, pool, True

    def release(self) -> None:
        if not self._held:
            raise PageError(f"Pin on pages {list(self.pages)} released twice")
        self._held = False
        self._pool.unpin(self.pages)

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_held", False):
            self._pool._dropped(self.pages, self.owner)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, high_watermark: float = 1.0,
                 low_watermark: float = 1.0) -> None:
        """Watermarks are fractions of the pool in use (pinned or cached); 1.0 / 1.0 evicts
        only on demand."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a pool needs pages of >= 1 slot, got {num_pages} x {page_size}")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1, got "
                             f"low {low_watermark}, high {high_watermark}")
        self.num_pages, self.page_size = num_pages, page_size
        self.num_online = num_pages  # pages [num_online, num_pages) are offline
        self._watermarks = high_watermark, low_watermark
        self._set_watermarks()
        # per page, indexed by page id; the state is derived: refs > 0 pinned, else key set
        # cached, else free
        self._refs = [0] * num_pages
        self._kind: list[Kind] = ["kv"] * num_pages
        self._owner: list[object] = [None] * num_pages
        self._key: list[Hashable | None] = [None] * num_pages
        self._last = [0] * num_pages
        self._tick = 0
        self._is_free = bytearray(b"\x01") * num_pages
        # every free page has >= 1 entry; stale entries (pages taken since) are skipped
        self._stack = list(range(num_pages - 1, -1, -1))
        self._num_free = num_pages
        self._by_key: dict[Hashable, int] = {}
        self._lru: dict[Kind, OrderedDict[int, None]] = {k: OrderedDict() for k in KINDS}
        self._leaked: list[Sequence[int]] = []
        self.evictions: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        self.leaked_pins = 0

    @classmethod
    def from_config(cls, num_pages: int, cache: CacheConfig) -> PagePool:
        return cls(num_pages, cache.block_size, cache.high_watermark, cache.low_watermark)

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return sum(map(len, self._lru.values()))

    @property
    def num_pinned(self) -> int:
        return self.num_online - self._num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Pages an allocation can get without preempting anyone (free + cached)."""
        return self._num_free + self.num_cached

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def set_online(self, n: int) -> int:
        """Pages [0, n) online, the rest offline: pages going offline must be free (PageError
        otherwise, changing nothing); pages coming online come free, lowest ids allocated
        first. Returns how many came online (negative: went offline)."""
        if not 0 <= n <= self.num_pages:
            raise ValueError(f"cannot have {n} of {self.num_pages} pages online")
        old, is_free = self.num_online, self._is_free
        if n < old:
            taken = is_free.find(0, n, old)
            if taken >= 0:
                raise PageError(f"page {taken} is {self._state(taken)}: only free pages go "
                                "offline")
            is_free[n:old] = bytes(old - n)  # their stack entries turn stale
        elif n > old:
            is_free[old:n] = b"\x01" * (n - old)
            self._stack += range(n - 1, old - 1, -1)
            if len(self._stack) > 2 * self.num_pages:  # bound the stale entries
                self._stack = [p for p in dict.fromkeys(self._stack) if is_free[p]]
        self._num_free += n - old
        self.num_online = n
        self._set_watermarks()
        return n - old

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, n: int, kind: Kind = "kv", owner: object = None) -> list[int]:
        """n pages (any ids), each pinned once for `owner`. Evicts cached pages when short or
        past the high watermark; raises PoolExhausted, evicting nothing, when free plus
        cached pages are fewer than n."""
        if n < 0 or kind not in self._lru:
            raise ValueError(f"cannot allocate {n} pages of kind {kind!r} (kinds: {KINDS})")
        if (self._num_free - n < self._evict_below or self._leaked) and not self._make_room(n):
            raise self._exhausted(n, kind)
        stack, is_free = self._stack, self._is_free
        self._num_free -= n
        out: list[int] = []
        while len(out) < n:
            p = stack.pop()
            if is_free[p]:  # else a stale entry: a range took the page
                is_free[p] = 0
                out.append(p)
        self._tick = t = self._tick + 1
        refs, kinds, owners, last = self._refs, self._kind, self._owner, self._last
        for p in out:
            refs[p] = 1
            kinds[p] = kind
            owners[p] = owner
            last[p] = t
        return out

    def allocate_range(self, n: int, kind: Kind = "adapter", owner: object = None) -> range:
        """n contiguous pages, each pinned once, from the smallest free run that fits (best
        fit leaves large runs for large requests). With no run long enough it evicts LRU
        cached pages until one is: possibly the whole cache, then PoolExhausted."""
        if n < 1 or kind not in self._lru:
            raise ValueError(f"cannot allocate a range of {n} pages of kind {kind!r}")
        if (self._num_free - n < self._evict_below or self._leaked) and not self._make_room(n):
            raise self._exhausted(n, kind, self.largest_free_range)
        start, length = self._best_fit(n)
        while length < n:
            if not self.num_cached:
                raise self._exhausted(n, kind, self.largest_free_range)
            start, length = self._run_at(self._evict_one())  # the only run that grew
        self._is_free[start:start + n] = bytes(n)
        self._num_free -= n
        if len(self._stack) > self._num_free + self.num_pages:  # bound the stale entries
            self._stack = [p for p in dict.fromkeys(self._stack) if self._is_free[p]]
        self._tick = t = self._tick + 1
        for p in range(start, start + n):
            self._refs[p], self._kind[p], self._owner[p], self._last[p] = 1, kind, owner, t
        return range(start, start + n)

    # -- pins ----------------------------------------------------------------------------

    def retain(self, pages: Iterable[int], owner: object = None) -> None:
        """Add a pin to each page. A pinned page is then shared; a cached page (a lookup
        hit) leaves the LRU, pinned again, and `owner` becomes its owner."""
        refs = self._refs
        self._tick = t = self._tick + 1
        for p in pages:
            r = refs[p]
            if r == 0:
                if self._key[p] is None:
                    raise PageError(f"pin of free page {p}: allocate pages, then pin them")
                del self._lru[self._kind[p]][p]
                self._owner[p] = owner
            refs[p] = r + 1
            self._last[p] = t

    def pin(self, pages: Sequence[int], owner: object = None) -> Pin:
        """retain() behind a handle whose release() (or `with` block) unpins exactly once."""
        pages = tuple(pages)
        self.retain(pages, owner)
        return Pin(self, pages, owner)

    def unpin(self, pages: Iterable[int]) -> None:
        """Drop one pin from each page. A page losing its last pin becomes cached (most
        recently used) if it has a key (see cache()), else free."""
        refs = self._refs
        for p in pages:
            r = refs[p]
            if r < 1:
                raise PageError(f"unpin of page {p}, which is {self._state(p)}: it has no pin")
            refs[p] = r - 1
            if r == 1:
                if self._key[p] is None:
                    self._give_back(p)
                else:
                    self._lru[self._kind[p]][p] = None
                    self._tick = self._last[p] = self._tick + 1

    def free(self, pages: Iterable[int]) -> None:
        """Give back pages held by their one pin (the allocation's) and drop their content:
        they go free even if they have a key. Shared pages are unpinned instead."""
        refs, keys, is_free, stack = self._refs, self._key, self._is_free, self._stack
        for p in pages:
            if refs[p] != 1:
                raise PageError(self._free_error(p))
            refs[p] = 0
            key = keys[p]
            if key is not None:
                del self._by_key[key]
                keys[p] = None
            is_free[p] = 1  # _give_back, inlined: the decode step's hot path
            stack.append(p)
            self._num_free += 1

    # -- cached content ------------------------------------------------------------------

    def cache(self, page: int, key: Hashable) -> int:
        """Name a pinned page's content by `key` (e.g. a hash of its tokens) so that, once
        unpinned, it stays cached and lookup(key) finds it. Returns the page holding `key`:
        `page`, or an older page with that content (then `page` stays unkeyed and goes free
        when unpinned; the caller may switch to the returned page)."""
        if key is None:
            raise ValueError("a cache key cannot be None")
        if self._refs[page] < 1:
            raise PageError(f"cache of page {page}, which is {self._state(page)}: pin it first")
        old = self._key[page]
        if old is not None:
            if old == key:
                return page
            raise PageError(f"page {page} already holds key {old!r}, not {key!r}")
        held = self._by_key.setdefault(key, page)
        if held == page:
            self._key[page] = key
        return held

    def lookup(self, key: Hashable) -> int | None:
        """The page (pinned or cached) holding `key`. Changes nothing: retain() it to use it."""
        return self._by_key.get(key)

    def evict(self, n: int) -> int:
        """Evict up to n cached pages (LRU, KV first) now; returns how many went free."""
        if self._leaked:
            self._reclaim()
        n = max(0, min(n, self.num_cached))
        for _ in range(n):
            self._evict_one()
        return n

    # -- inspection ----------------------------------------------------------------------

    @property
    def largest_free_range(self) -> int:
        return max(map(len, _FREE_RUN.findall(self._is_free)), default=0)

    @property
    def fragmentation(self) -> float:
        """Largest free run / free pages: 1.0 when the free pages are one run (or none)."""
        return self.largest_free_range / self._num_free if self._num_free else 1.0

    def stats(self) -> PoolStats:
        """O(pages), at C speed (pinned pages per kind are counted, not tracked)."""
        if self._leaked:
            self._reclaim()
        pinned = Counter(compress(self._kind, self._refs))
        return PoolStats(self.num_pages, self._num_free,
                         {k: len(lru) for k, lru in self._lru.items()},
                         {k: pinned[k] for k in KINDS}, dict(self.evictions), self.leaked_pins,
                         self.largest_free_range, self.fragmentation,
                         self.num_pages - self.num_online)

    def page_info(self, page: int) -> PageInfo:
        return PageInfo(self._state(page), self._kind[page], self._refs[page],
                        self._owner[page], self._key[page], self._last[page])

    def check_invariants(self) -> None:
        """O(pages) consistency check for tests: the free map, free stack, LRUs and key index
        agree with refcounts and keys (so each page is in exactly one state) and counts add
        up."""
        refs, keys, kinds, pages = self._refs, self._key, self._kind, range(self.num_online)
        assert min(refs) >= 0, f"a negative refcount: {min(refs)}"
        offline = range(self.num_online, self.num_pages)
        assert not any(refs[p] or keys[p] is not None or self._is_free[p] for p in offline), \
            "an offline page is pinned, cached or free"
        unpinned = set(compress(pages, map(operator.not_, refs)))
        unkeyed = set(compress(pages, map(operator.is_, keys, repeat(None))))
        free, cached = set(compress(pages, self._is_free)), unpinned - unkeyed
        assert free == unpinned & unkeyed, "the free map disagrees with refcounts and keys"
        assert len(free) == self._num_free, f"{len(free)} free pages, {self._num_free} counted"
        assert free.issubset(self._stack), "a free page missing from the free stack"
        in_lru = [p for kind, lru in self._lru.items() for p in lru if kinds[p] == kind]
        assert len(in_lru) == len(cached) == self.num_cached and cached.issuperset(in_lru), \
            "the LRUs do not hold exactly the cached pages"
        assert self.num_pinned == len(pages) - len(unpinned), "pinned pages do not add up"
        assert len(self._by_key) == len(pages) - len(unkeyed), "keys not indexed"
        assert [keys[p] for p in self._by_key.values()] == list(self._by_key), "key index"

    # -- internals -----------------------------------------------------------------------

    def _state(self, page: int) -> str:
        if page >= self.num_online:
            return "offline"
        if self._refs[page] > 0:
            return "pinned"
        return "free" if self._key[page] is None else "cached"

    def _free_error(self, page: int) -> str:
        r = self._refs[page]
        if r > 1:
            return f"free of page {page}, pinned {r} times: unpin a shared page instead"
        if self._key[page] is None:
            return f"free of page {page}, which is already free (double free)"
        return f"free of page {page}, which is cached, not pinned: evict it instead"

    def _set_watermarks(self) -> None:
        """An allocation that would leave fewer than _evict_below online pages free first
        evicts cached pages until _evict_to are free after it."""
        high, low = self._watermarks
        self._evict_below = round((1.0 - high) * self.num_online)
        self._evict_to = round((1.0 - low) * self.num_online)

    def _give_back(self, page: int) -> None:
        self._num_free += 1
        self._is_free[page] = 1
        self._stack.append(page)

    def _best_fit(self, n: int) -> tuple[int, int]:
        """The smallest free run of >= n pages as (start, length); length 0 if none. Runs
        shorter than n are skipped by bytes.find, in C."""
        is_free, need = self._is_free, b"\x01" * n
        best, best_len = -1, 0
        start = is_free.find(need)  # a run's first page: the search starts past a taken one
        while start >= 0:
            end = is_free.find(0, start + n)
            end = self.num_pages if end < 0 else end
            if not best_len or end - start < best_len:
                best, best_len = start, end - start
                if best_len == n:
                    break
            start = is_free.find(need, end)
        return best, best_len

    def _run_at(self, page: int) -> tuple[int, int]:
        """The free run through free `page` as (start, length)."""
        start = self._is_free.rfind(0, 0, page) + 1
        end = self._is_free.find(0, page)
        return start, (self.num_pages if end < 0 else end) - start

    def _evict_one(self) -> int:
        """Free the least recently used cached page of the first kind that has one."""
        for kind, lru in self._lru.items():
            if lru:
                page, _ = lru.popitem(last=False)
                del self._by_key[self._key[page]]
                self._key[page] = None
                self.evictions[kind] += 1
                self._give_back(page)
                return page
        raise AssertionError("no cached page to evict")

    def _make_room(self, n: int) -> bool:
        """Reclaim dropped Pins; then, past the high watermark, evict until n pages can be
        taken leaving the low watermark's pages free (or the cache is empty). False, having
        evicted nothing, when even the whole cache would not make n."""
        if self._leaked:
            self._reclaim()
        if self._num_free - n >= self._evict_below:
            return True
        cached = self.num_cached
        if self._num_free + cached < n:
            return False
        target = n + self._evict_to
        while self._num_free < target and cached:
            self._evict_one()
            cached -= 1
        return True

    def _exhausted(self, n: int, kind: str, largest_range: int | None = None) -> PoolExhausted:
        return PoolExhausted(n, self._num_free, self.num_cached, self.num_pinned, kind,
                             largest_range)

    def _dropped(self, pages: Sequence[int], owner: object) -> None:
        """From Pin.__del__, which may run in the middle of any pool call: only record."""
        self.leaked_pins += 1
        self._leaked.append(pages)
        log.warning("a Pin on pages %s (owner %r) was dropped without release(); its pins "
                    "are reclaimed at the next allocation", list(pages), owner)

    def _reclaim(self) -> None:
        leaked, self._leaked = self._leaked, []
        for pages in leaked:
            try:
                self.unpin(pages)
            except PageError as e:
                log.warning("reclaiming a dropped Pin: %s", e)
