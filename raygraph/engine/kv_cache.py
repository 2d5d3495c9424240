"""A scheduler's KV blocks: pages of one PagePool, with prefix caching. Pure Python.

A full block (block_size tokens, each known and sent for computing) is keyed by a hash
chain, key_i = hash((key_{i-1}, the block's tokens, adapter id)) with key_-1 = 0, so a key
names the whole prefix up to its block's end. Keyed pages stay cached when their sequences
end or are preempted (LRU, evicted by the pool under its watermarks). A sequence admitted
with known tokens that start with cached blocks pins them and computes only the rest; at
least its last known token is always computed (its logits are sampled), so a fully cached
prompt recomputes its last block. Only full blocks are keyed and a sequence writes only past
its cached tokens, into its own last block: a shared block is never written.

Keys are Python's hash() of int tuples: deterministic within one process (the coordinator's,
the only one that keys). NOTE: 64 bits, not a cryptographic hash: prompts crafted to collide
with another prefix's key would be served that prefix's KV.
"""

from __future__ import annotations

import time
from bisect import bisect_left

import msgspec

from raygraph.engine.pages import PagePool
from raygraph.engine.sequence import Sequence
from raygraph.protocol import ALLOCATE_SAMPLE

# upper bounds (seconds) of raygraph:pool_allocate_seconds; one allocate is ~0.5 us, one that
# evicts a batch of cached pages down to the low watermark takes longer
ALLOCATE_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3,
                    2.5e-3, 1e-2, 0.1)


class Histogram:
    """Counts per bucket (the last one: above every bound), their sum and count."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts = bounds, [0] * (len(bounds) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class KVCacheStats(msgspec.Struct, frozen=True):
    """One scheduler's pool and prefix cache, for coordinator.stats() and /metrics."""

    num_pages: int
    free: int
    cached: int  # unpinned pages kept for their content
    pinned: int  # pages in use
    evictions: int  # since start
    prefix_cache_queries: int  # known tokens of admitted sequences, looked up
    prefix_cache_hits: int  # of those, tokens found cached (not computed)
    allocate_counts: list[int]  # per ALLOCATE_BUCKETS bucket (+ one above), sampled calls
    allocate_sum: float
    allocate_count: int
    offline: int = 0  # pages a staged wake has not mapped yet (counted in num_pages)

    @property
    def usage(self) -> float:
        """Online pages in use (pinned), 0 to 1: cached pages are free to take, offline
        ones are left out."""
        return self.pinned / max(1, self.num_pages - self.offline)


def merge_stats(stats: list[KVCacheStats]) -> dict:
    """Every DP group's pool as one dict of builtins: page counts, evictions, queries, hits
    and the allocation histogram summed; usage of the fullest group."""
    def total(field: str) -> int:
        return sum(getattr(s, field) for s in stats)

    queries = sum(s.prefix_cache_queries for s in stats)
    hits = sum(s.prefix_cache_hits for s in stats)
    return {
        "usage": max((s.usage for s in stats), default=0.0),
        "num_pages": total("num_pages"),
        "pages": {"free": total("free"), "cached": total("cached"), "pinned": total("pinned"),
                  "offline": total("offline")},
        "evictions": total("evictions"),
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "allocate_seconds": {
            "bounds": list(ALLOCATE_BUCKETS),
            "counts": [sum(c) for c in zip(*(s.allocate_counts for s in stats))]
            or [0] * (len(ALLOCATE_BUCKETS) + 1),
            "sum": sum(s.allocate_sum for s in stats),
            "count": sum(s.allocate_count for s in stats)},
    }


class KVCacheManager:
    def __init__(self, pool: PagePool, prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.page_size
        self.prefix_caching = prefix_caching
        self.queries = self.hits = 0  # tokens, over admissions
        self.allocate_seconds = Histogram(ALLOCATE_BUCKETS)
        self._allocations = 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take without preempting (free + cached)."""
        return self.pool.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int, owner: int) -> list[int]:
        """n new private blocks; the caller checked num_available. Every ALLOCATE_SAMPLE-th
        call is timed into allocate_seconds."""
        self._allocations += 1
        if self._allocations % ALLOCATE_SAMPLE:
            return self.pool.allocate(n, owner)
        t0 = time.perf_counter()
        pages = self.pool.allocate(n, owner)
        self.allocate_seconds.observe(time.perf_counter() - t0)
        return pages

    def match(self, seq: Sequence) -> list[int]:
        """The pages holding seq's leading full blocks, up to the first miss, leaving at least
        its last known token to compute. Changes nothing (admit() pins them)."""
        if not self.prefix_caching:
            return []
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        lookup, hits = self.pool.lookup, []
        for key in self._hashes(seq, (known - 1) // self.block_size):
            page = lookup(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def first_miss(self, seq: Sequence, hits: list[int]) -> int | None:
        """The key of the first full block seq would compute itself (after match()); None
        when it computes no full block or caching is off."""
        keys = seq.block_hashes
        return keys[len(hits)] if self.prefix_caching and len(hits) < len(keys) else None

    def admit(self, seq: Sequence, hits: list[int], need: int) -> bool:
        """Give seq (with no blocks) the cached blocks `hits` and `need` new ones, and start it
        after the cached tokens; False when that needs a preemption (then only the hits'
        places in the LRU changed)."""
        pool = self.pool
        pool.retain(hits, seq.seq_id)  # first: they are no longer cached, so not evicted
        if need > pool.num_available:
            pool.unpin(reversed(hits))
            return False
        seq.block_table = hits + self.allocate(need, seq.seq_id)
        seq.num_keyed = len(hits)
        seq.num_computed = seq.num_cached_tokens = len(hits) * self.block_size
        if self.prefix_caching:
            self.queries += seq.num_tokens
            self.hits += seq.num_computed
        return True

    def commit(self, seq: Sequence) -> None:
        """Key seq's full blocks whose tokens are all known and sent for computing."""
        full = min(seq.num_computed,
                   len(seq.prompt_token_ids) + len(seq.output_token_ids)) // self.block_size
        if full <= seq.num_keyed:
            return
        hashes, table, cache = self._hashes(seq, full), seq.block_table, self.pool.cache
        for i in range(seq.num_keyed, full):
            # another page may hold this content already (computed twice, e.g. by two
            # prompts admitted in one step): ours stays unkeyed and goes free when released
            cache(table[i], hashes[i])
        seq.num_keyed = full

    def release(self, seq: Sequence) -> None:
        """Unpin seq's blocks (finished, aborted or preempted), keying its full computed
        blocks first: keyed ones stay cached, the rest go free. The last block first, so the
        LRU evicts a prefix from its end and the blocks left cached stay reachable."""
        if self.prefix_caching:
            self.commit(seq)
        self.pool.unpin(reversed(seq.block_table))
        seq.block_table = []
        seq.num_keyed = 0

    def clear(self) -> int:
        """Evict every cached block (the workers' KV memory was released); returns how many.
        Counted as evictions."""
        return self.pool.evict(self.pool.num_cached)

    def _hashes(self, seq: Sequence, n: int) -> list[int]:
        """The keys of seq's first n blocks (known tokens), kept on seq across preemption."""
        hashes = seq.block_hashes
        done = len(hashes)
        if done < n:
            bs, adapter, tokens = self.block_size, seq.adapter_id, seq.prompt_token_ids
            if n * bs > len(tokens):
                tokens = tokens + seq.output_token_ids
            h = hashes[-1] if done else 0
            for start in range(done * bs, n * bs, bs):
                h = hash((h, tuple(tokens[start:start + bs]), adapter))
                hashes.append(h)
        return hashes

    def stats(self) -> KVCacheStats:
        p, h = self.pool.stats(), self.allocate_seconds
        return KVCacheStats(p.num_pages, p.free, p.cached, p.pinned, p.evictions, self.queries,
                            self.hits, list(h.counts), h.sum, h.count, p.offline)
