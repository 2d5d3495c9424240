"""The pool of fixed-size pages behind a scheduler's KV blocks and prefix cache.

Pure Python bookkeeping (no torch): the scheduler owns one, workers only see page ids. A page
is free, pinned (refcount > 0: a request or a step uses it) or cached (refcount 0, but its
content, named by a key, is kept for reuse until evicted):

    free --allocate--> pinned --last unpin--> cached (page has a key) | free (no key)
    cached --retain (a lookup hit)--> pinned        cached --evict--> free

Pages [num_online, num_pages) are offline: neither free nor cached, never handed out, and
left out of the watermarks and of usage. A staged wake (memory/kv_arena.py) maps the KV
cache's first blocks first: the pool offers only those, and set_online() adds the rest in
page order as the workers map them.

Cached pages are evicted LRU in batches between two watermarks (see CacheConfig). Single
pages cost O(1): the free pages are a stack (the most recently freed page goes out first)
and the cached ones an ordered dict, least recently used first.

NOTE: not thread-safe (one owner drives it). PageError means a caller bug and is raised
before the offending page changes, but pages earlier in the same call stay changed.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from itertools import compress, repeat
from typing import TYPE_CHECKING, NamedTuple

import msgspec

if TYPE_CHECKING:
    from raygraph.config import CacheConfig


class PageError(RuntimeError):
    """A page used against its state: double free, unpin without a pin."""


class PoolExhausted(RuntimeError):
    """Too few pages even with every cached page evicted: the scheduler preempts and retries."""

    def __init__(self, needed: int, free: int, cached: int, pinned: int) -> None:
        super().__init__(needed, free, cached, pinned)  # picklable
        self.needed, self.free, self.cached, self.pinned = needed, free, cached, pinned

    def __str__(self) -> str:
        return (f"cannot allocate {self.needed} pages: {self.free} free, {self.cached} cached, "
                f"{self.pinned} pinned; preempt to make room")


class PageInfo(NamedTuple):
    state: str  # free | cached | pinned | offline
    refs: int
    owner: object
    key: Hashable | None
    last_access: int  # the pool's operation counter at the last pin or unpin, not wall time


class PoolStats(msgspec.Struct, frozen=True):
    """Page counts per state and evictions since start, for metrics."""

    num_pages: int
    free: int
    cached: int
    pinned: int
    evictions: int
    offline: int = 0  # pages past num_online (a staged wake has not mapped them yet)


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
        self._owner: list[object] = [None] * num_pages
        self._key: list[Hashable | None] = [None] * num_pages
        self._last = [0] * num_pages
        self._tick = 0
        self._stack = list(range(num_pages - 1, -1, -1))  # the free pages, next out last
        self._by_key: dict[Hashable, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # the cached pages, oldest first
        self.evictions = 0

    @classmethod
    def from_config(cls, num_pages: int, cache: CacheConfig) -> PagePool:
        return cls(num_pages, cache.block_size, cache.high_watermark, cache.low_watermark)

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._stack)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_pinned(self) -> int:
        return self.num_online - len(self._stack) - len(self._lru)

    @property
    def num_available(self) -> int:
        """Pages an allocation can get without preempting anyone (free + cached)."""
        return len(self._stack) + len(self._lru)

    def set_online(self, n: int) -> int:
        """Pages [0, n) online, the rest offline: pages going offline must be free (PageError
        otherwise, changing nothing); pages coming online come free, lowest ids allocated
        first. Returns how many came online (negative: went offline)."""
        if not 0 <= n <= self.num_pages:
            raise ValueError(f"cannot have {n} of {self.num_pages} pages online")
        old, refs, keys = self.num_online, self._refs, self._key
        if n < old:
            taken = next((p for p in range(n, old) if refs[p] or keys[p] is not None), None)
            if taken is not None:
                raise PageError(f"page {taken} is {self._state(taken)}: only free pages go "
                                "offline")
            self._stack = [p for p in self._stack if p < n]
        elif n > old:
            self._stack += range(n - 1, old - 1, -1)
        self.num_online = n
        self._set_watermarks()
        return n - old

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, n: int, owner: object = None) -> list[int]:
        """n pages (any ids), each pinned once for `owner`. Evicts cached pages when short or
        past the high watermark; raises PoolExhausted, evicting nothing, when free plus
        cached pages are fewer than n."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if len(self._stack) - n < self._evict_below and not self._make_room(n):
            raise PoolExhausted(n, self.num_free, self.num_cached, self.num_pinned)
        stack = self._stack
        cut = len(stack) - n
        out = stack[cut:]
        del stack[cut:]
        out.reverse()  # the most recently freed page first
        self._tick = t = self._tick + 1
        refs, owners, last = self._refs, self._owner, self._last
        for p in out:
            refs[p] = 1
            owners[p] = owner
            last[p] = t
        return out

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
                del self._lru[p]
                self._owner[p] = owner
            refs[p] = r + 1
            self._last[p] = t

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
                    self._stack.append(p)
                else:
                    self._lru[p] = None
                    self._tick = self._last[p] = self._tick + 1

    def free(self, pages: Iterable[int]) -> None:
        """Give back pages held by their one pin (the allocation's) and drop their content:
        they go free even if they have a key. Shared pages are unpinned instead."""
        refs, keys, stack = self._refs, self._key, self._stack
        for p in pages:
            if refs[p] != 1:
                raise PageError(self._free_error(p))
            refs[p] = 0
            key = keys[p]
            if key is not None:
                del self._by_key[key]
                keys[p] = None
            stack.append(p)

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
        """Evict up to n cached pages (least recently used first) now; returns how many went
        free."""
        n = max(0, min(n, len(self._lru)))
        for _ in range(n):
            self._evict_one()
        return n

    # -- inspection ----------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_free, self.num_cached, self.num_pinned,
                         self.evictions, self.num_pages - self.num_online)

    def page_info(self, page: int) -> PageInfo:
        return PageInfo(self._state(page), self._refs[page], self._owner[page],
                        self._key[page], self._last[page])

    def check_invariants(self) -> None:
        """O(pages) consistency check for tests: the free stack, LRU and key index agree with
        refcounts and keys, so each page is in exactly one state."""
        refs, keys, pages = self._refs, self._key, range(self.num_online)
        assert min(refs) >= 0, f"a negative refcount: {min(refs)}"
        offline = range(self.num_online, self.num_pages)
        assert not any(refs[p] or keys[p] is not None for p in offline), \
            "an offline page is pinned or cached"
        unpinned = set(compress(pages, map(operator.not_, refs)))
        unkeyed = set(compress(pages, map(operator.is_, keys, repeat(None))))
        stack = set(self._stack)
        assert len(stack) == len(self._stack), "a page twice in the free stack"
        assert stack == unpinned & unkeyed, "the free stack does not hold exactly the free pages"
        assert self._lru.keys() == unpinned - unkeyed, \
            "the LRU does not hold exactly the cached pages"
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

    def _evict_one(self) -> None:
        """Free the least recently used cached page."""
        page, _ = self._lru.popitem(last=False)
        del self._by_key[self._key[page]]
        self._key[page] = None
        self.evictions += 1
        self._stack.append(page)

    def _make_room(self, n: int) -> bool:
        """Evict until n pages can be taken leaving the low watermark's pages free (or the
        cache is empty). False, having evicted nothing, when even the whole cache would not
        make n."""
        if len(self._stack) + len(self._lru) < n:
            return False
        target = n + self._evict_to
        while len(self._stack) < target and self._lru:
            self._evict_one()
        return True
