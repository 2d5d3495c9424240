"""The offload engine's pure logic: the floor, ring placement and the LRU pool.

No torch and no CUDA here, so every rule (the floor, which copy waits for which kernel,
what LRU evicts, every load-time error) is tested on CPU in milliseconds. Sizes are bytes;
offsets are into one GPU region the engine owns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ALIGN = 256  # every weight starts at a multiple of this (>= any dtype's alignment)


class OffloadError(RuntimeError):
    """Misuse of the offload engine; the message names the weight."""


class OffloadBudgetError(OffloadError):
    """The GPU budget is below what the recorded access order needs."""

    def __init__(self, budget: int, floor: int, detail: str) -> None:
        super().__init__(f"offload budget {budget} bytes is below the floor: at least {floor} "
                         f"bytes are needed ({detail})")
        self.budget = budget
        self.floor = floor
        self.detail = detail

    def __reduce__(self) -> tuple:  # crosses actors: rebuilt from its own arguments
        return type(self), (self.budget, self.floor, self.detail)


class OffloadOrderError(OffloadError):
    """A forward accessed the weights in another order than the recorded one."""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    nbytes: int


@dataclass(frozen=True)
class Floor:
    """floor = resident + max over consecutive accesses (i, i+1) of their aligned bytes.

    The pair is what double buffering needs: weight i+1 is copied while kernel i reads
    weight i. The alignment padding of the two is the prefetch headroom.
    """

    bytes: int
    resident: int
    pair: tuple[str, str]

    def check(self, budget: int) -> None:
        if budget < self.bytes:
            raise OffloadBudgetError(
                budget, self.bytes,
                f"{self.resident} resident + weights {self.pair[0]!r} and {self.pair[1]!r} "
                "in the budget together")


def compute_floor(order: Sequence[WeightSpec], resident: int) -> Floor:
    """The smallest budget at which copy i+1 can overlap kernel i for every i (cyclic: the
    next step's first weight follows this step's last)."""
    if not order:
        raise OffloadError("no offloaded weight was accessed in the recorded forward")
    n = len(order)
    best = max(range(n), key=lambda i: aligned(order[i].nbytes)
               + (aligned(order[(i + 1) % n].nbytes) if n > 1 else 0))
    a, b = order[best], order[(best + 1) % n]
    pair = aligned(a.nbytes) + (aligned(b.nbytes) if n > 1 else 0)
    return Floor(resident + pair, resident, (a.name, b.name))


def check_order(recorded: Sequence[str], offloaded: Sequence[str]) -> None:
    """Every offloaded weight is read exactly once per forward."""
    seen: set[str] = set()
    for name in recorded:
        if name in seen:
            raise OffloadError(f"weight {name!r} is read twice in one forward; each offloaded "
                               "weight must be read once")
        seen.add(name)
    unused = [n for n in offloaded if n not in seen]
    if unused:
        raise OffloadError(f"offloaded weights never read by the recorded forward: {unused[:8]}")


# ---- ring: a static placement, the same address for a weight on every forward ----------

@dataclass(frozen=True)
class RingSlot:
    offset: int
    wait_for: int  # the last earlier access (this forward) whose bytes this one overwrites
    issue_after: int  # issue the copy once this access's kernel is enqueued; -1: at the start


def _overlaps(a: int, na: int, b: int, nb: int) -> bool:
    return a < b + nb and b < a + na


def _wait_for(slots: list[tuple[int, int]], off: int, size: int) -> int:
    hits = [i for i, (o, n) in enumerate(slots) if _overlaps(off, size, o, n)]
    return max(hits, default=-1)


def _greedy(sizes: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """Each access at the candidate offset (after the last one, at the start, at the end)
    whose bytes were last used longest ago, so its copy can start earliest."""
    placed: list[tuple[int, int]] = []
    cursor = 0
    for size in sizes:
        cands = [c for c in (cursor, 0, capacity - size) if 0 <= c and c + size <= capacity]
        off = min(cands, key=lambda c: _wait_for(placed, c, size))
        placed.append((off, size))
        cursor = off + size
    return placed


def _two_ended(sizes: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """Even accesses at the start, odd ones at the end: neighbours never overlap when any
    two consecutive sizes fit together."""
    return [(0 if i % 2 == 0 else capacity - s, s) for i, s in enumerate(sizes)]


def ring_plan(sizes: Sequence[int], capacity: int) -> list[RingSlot]:
    """Fixed offsets inside `capacity` bytes for one forward's accesses, in order.

    Copy j may only start once every earlier access it overlaps has been read (wait_for).
    Copies are issued in access order (issue_after is non-decreasing) so the copy stream
    always moves the next-needed weight first.
    """
    sizes = [aligned(s) for s in sizes]
    too_big = [i for i, s in enumerate(sizes) if s > capacity]
    if too_big:
        raise OffloadError(f"access {too_big[0]} needs {sizes[too_big[0]]} bytes; the ring "
                           f"holds {capacity}")
    best: list[RingSlot] = []
    for placed in (_greedy(sizes, capacity), _two_ended(sizes, capacity)):
        slots, issue = [], -1
        for j, (off, size) in enumerate(placed):
            wait = _wait_for(placed[:j], off, size)
            issue = max(issue, wait)
            slots.append(RingSlot(off, wait, issue))
        if not best or _stalls(slots) < _stalls(best):
            best = slots
    return best


def _stalls(slots: Sequence[RingSlot]) -> int:
    """Accesses whose copy cannot overlap the kernel right before them."""
    return sum(1 for j, s in enumerate(slots) if j > 0 and s.wait_for == j - 1)


# ---- LRU: a capped pool of per-weight allocations --------------------------------------

class LruPool:
    """First-fit placement inside `capacity` bytes; least recently used weights are evicted
    until a request fits. Pinned weights (in use or in flight) are never evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.where: OrderedDict[str, tuple[int, int]] = OrderedDict()  # oldest use first
        self.evictions = 0

    def lookup(self, name: str) -> int | None:
        """Offset of a resident weight (and mark it used), or None."""
        if name not in self.where:
            return None
        self.where.move_to_end(name)
        return self.where[name][0]

    def _hole(self, size: int, gone: set[str]) -> int | None:
        """First offset with `size` free bytes if the weights in `gone` were evicted."""
        cursor = 0
        for off, n in sorted(v for k, v in self.where.items() if k not in gone):
            if off - cursor >= size:
                return cursor
            cursor = max(cursor, off + n)
        return cursor if self.capacity - cursor >= size else None

    def place(self, name: str, size: int, pinned: set[str]) -> tuple[int, list[str]] | None:
        """(offset, evicted names) for a new weight, or None when only pinned weights block
        it. A weight larger than the whole pool is an error."""
        size = aligned(size)
        if size > self.capacity:
            raise OffloadBudgetError(self.capacity, size,
                                     f"weight {name!r} alone does not fit the pool")
        # choose the victims first, evict only once the weight fits: a refusal changes nothing
        victims = (n for n in self.where if n not in pinned)  # oldest use first
        evicted: list[str] = []
        gone: set[str] = set()
        while (off := self._hole(size, gone)) is None:
            victim = next(victims, None)
            if victim is None:
                return None
            evicted.append(victim)
            gone.add(victim)
        for victim in evicted:
            del self.where[victim]
        self.where[name] = (off, size)
        self.evictions += len(evicted)
        return off, evicted


def split_ring(sizes: Sequence[int], capacity: int, depth: int = 3) -> tuple[list[int], int]:
    """(accesses kept resident, ring bytes) for a ring mode budget.

    The ring gets room for `depth` consecutive accesses (one read, the next ones in
    flight); what the budget has beyond that holds weights that are never copied again,
    largest first, and whatever is left widens the ring.
    """
    sizes = [aligned(s) for s in sizes]
    if sum(sizes) <= capacity:
        return list(range(len(sizes))), 0
    n = len(sizes)
    window = max(sum(sizes[(i + k) % n] for k in range(min(depth, n))) for i in range(n))
    room = capacity - min(capacity, window)
    kept = []
    for i in sorted(range(n), key=lambda i: -sizes[i]):
        if sizes[i] <= room:
            kept.append(i)
            room -= sizes[i]
    return sorted(kept), capacity - sum(sizes[i] for i in kept)
