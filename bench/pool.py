"""PagePool cost per operation, on a CPU (the pool is pure Python).

    python -m bench.pool [--pages 100000] [--iters 200000] [--repeats 5]

Prints ns/op (the best of --repeats runs: the least disturbed by other processes) for:
allocate + free of one page, allocate + cache + unpin of one page in a full cache (each
allocation evicts), retain + unpin, a lookup hit, a lookup hit pinned and unpinned, stats();
and the pool's calls in a 256-sequence decode step (a new page every page_size tokens, a
finished sequence's pages cached and its successor's prefix hit). Loop overhead is included,
not subtracted.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from raygraph.engine.pages import PagePool


def best_ns(fn: Callable[[int], None], iters: int, repeats: int) -> float:
    """Best per-op time of `fn(iters)`, which runs the operation `iters` times."""
    runs = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        fn(iters)
        runs.append((time.perf_counter_ns() - t) / iters)
    return min(runs)


def half_pinned(pages: int) -> PagePool:
    pool = PagePool(pages, 16)
    pool.allocate(pages // 2)
    return pool


def alloc_free(pool: PagePool) -> Callable[[int], None]:
    allocate, free = pool.allocate, pool.free

    def run(iters: int) -> None:
        for _ in range(iters):
            free(allocate(1))

    return run


def alloc_cache_evict(pool: PagePool) -> Callable[[int], None]:
    """The prefix cache's steady state: every page is cached or pinned, each new page
    evicts the least recently used one."""
    allocate, cache, unpin = pool.allocate, pool.cache, pool.unpin
    for i, p in enumerate(pool.allocate(pool.num_free)):
        cache(p, -1 - i)
    pool.unpin([p for p in range(pool.num_pages) if pool.page_info(p).key is not None])
    key = iter(range(10**12))

    def run(iters: int) -> None:
        for _ in range(iters):
            pages = allocate(1)
            cache(pages[0], next(key))
            unpin(pages)

    return run


def retain_unpin(pool: PagePool) -> Callable[[int], None]:
    retain, unpin, pages = pool.retain, pool.unpin, pool.allocate(1)

    def run(iters: int) -> None:
        for _ in range(iters):
            retain(pages)
            unpin(pages)

    return run


def lookup_hit(pool: PagePool, then_pin: bool) -> Callable[[int], None]:
    lookup, retain, unpin = pool.lookup, pool.retain, pool.unpin
    [p] = pool.allocate(1)
    pool.cache(p, ("block", 123456789, 0))
    pool.unpin([p])
    key = ("block", 123456789, 0)

    def run(iters: int) -> None:
        for _ in range(iters):
            lookup(key)

    def run_pinned(iters: int) -> None:
        for _ in range(iters):
            hit = [lookup(key)]
            retain(hit)
            unpin(hit)

    return run_pinned if then_pin else run


def decode_steps(pages: int, seqs: int = 256) -> Callable[[int], None]:
    """`seqs` sequences decoding one token per step: each step the 1/16 of them that cross a
    page boundary key their full page and take a new one, or, at their length, unpin their
    pages (left cached) and a new sequence takes their place, hitting the 4-page prefix all
    share. Only those sequences are visited, so the time is mostly the pool's."""
    pool = PagePool(pages, 16, 0.95, 0.90)
    rng = random.Random(0)
    lens = [16 * rng.randrange(8, 128) for _ in range(seqs)]
    tables: list[list[int]] = [[] for _ in range(seqs)]
    done = [0] * seqs
    serial = iter(range(10**12))

    def start(i: int) -> None:
        hits = [pool.lookup(("prefix", j)) for j in range(4)]
        if None in hits:
            tables[i] = pool.allocate(4)
            for j, p in enumerate(tables[i]):
                pool.cache(p, ("prefix", j))
        else:
            pool.retain(hits)
            tables[i] = hits
        done[i] = 64

    for i in range(seqs):
        start(i)
        done[i] += 16 * rng.randrange(lens[i] // 16 - 4)  # staggered: not all finish at once

    def run(steps: int) -> None:
        for step in range(steps):
            for i in range(step % 16, seqs, 16):
                done[i] += 16
                if done[i] >= lens[i]:
                    pool.unpin(tables[i])
                    start(i)
                else:
                    if len(tables[i]) > 4:  # the page just filled, past the shared prefix
                        pool.cache(tables[i][-1], next(serial))
                    tables[i] += pool.allocate(1)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--iters", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    few = max(a.iters // 100, 10)
    stats_pool = half_pinned(a.pages)
    cases: list[tuple[str, Callable[[int], None], int]] = [
        ("allocate(1) + free, one page", alloc_free(half_pinned(a.pages)), a.iters),
        ("allocate(1) + cache + unpin, evicting", alloc_cache_evict(half_pinned(a.pages)),
         a.iters),
        ("retain + unpin, one page", retain_unpin(half_pinned(a.pages)), a.iters),
        ("lookup hit", lookup_hit(half_pinned(a.pages), False), a.iters),
        ("lookup hit + retain + unpin", lookup_hit(half_pinned(a.pages), True), a.iters),
        ("stats()", lambda k: [stats_pool.stats() for _ in range(k)] and None, 20),
        ("decode step, 256 sequences", decode_steps(a.pages), few),
    ]
    print(f"PagePool, {a.pages} pages, best of {a.repeats}")
    for name, fn, iters in cases:
        ns = best_ns(fn, iters, a.repeats)
        print(f"{name:40s} {ns:12,.0f} ns/op")


if __name__ == "__main__":
    main()
