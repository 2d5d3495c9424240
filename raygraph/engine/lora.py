"""The coordinator's LoRA adapters: a registry of names and a hot-slot manager. Pure Python.

A registered adapter has a name, an adapter id (>= 1; part of every prefix-cache key, so
blocks computed under one adapter are never another's) and a path. `max_loras` slots on the
workers hold the hot ones. A slot used by a sequence in the system is pinned (refcounted);
among unpinned slots the least recently used is evicted first (a demotion: the workers keep
its tensors in their warm tier). When every slot is pinned, a request for a cold adapter
waits: its batch-mates and requests for hot adapters do not.

Called from the event loop (register, unregister, lookups) and the step thread (acquire,
release), so every method takes the lock.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from raygraph.engine.kv_cache import Histogram
from raygraph.engine.sequence import Sequence
from raygraph.errors import LoRAError, UnknownAdapter
from raygraph.protocol import LoRALoad

# upper bounds (seconds) of the load-time histogram /metrics exports
log = logging.getLogger("raygraph.coordinator")

LOAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
Tier = str  # "hot" (in a slot), "warm" (the workers' host copy), "cold" (files)


class NoRoom(LoRAError):
    """The name is taken or the registry is full: nothing was read."""


@dataclass
class Adapter:
    name: str
    adapter_id: int
    path: str
    rank: int
    slot: int | None = None  # hot: the slot holding it
    users: int = 0  # sequences in the system naming it (waiting for a slot or in one)
    requests: int = 0  # sequences ever submitted for it


@dataclass(frozen=True)
class Grant:
    slot: int
    load: bool  # the slot must be loaded with the adapter before a step names it
    evicted: str | None = None  # the adapter demoted to make room


def allowed_path(path: str, roots: tuple[str, ...]) -> str | None:
    """`path` with links resolved if it lies under one of `roots`, else None. Nothing is read
    or opened: the answer says nothing of what exists."""
    real = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if os.path.commonpath([real, top]) == top:
            return real
    return None


class LoRARegistry:
    def __init__(self, max_loras: int, read_rank: Callable[[str], int],
                 max_adapters: int = 64) -> None:
        """`read_rank(path)`: read and check an adapter, its rank; raises LoRAError."""
        if max_loras < 1:
            raise LoRAError("LoRA is off (max_loras = 0): no adapter can be served")
        self.max_loras = max_loras
        self.max_adapters = max_adapters
        self._read_rank = read_rank
        self._lock = threading.RLock()
        self._adapters: dict[str, Adapter] = {}
        self._ids = 0
        self._slots: list[str | None] = [None] * max_loras  # slot -> adapter name
        self._pins = [0] * max_loras
        self._unpinned: OrderedDict[int, None] = OrderedDict()  # hot, unpinned: LRU first
        self.hits = self.misses = 0
        self.moves: Counter[tuple[Tier, Tier]] = Counter()  # (from, to): promotions, demotions
        self.load_seconds = Histogram(LOAD_BUCKETS)
        self.load_times: dict[Tier, deque[float]] = {t: deque(maxlen=10_000)
                                                     for t in ("warm", "cold")}

    # ---- names (event loop) ---------------------------------------------------------
    def register(self, name: str, path: str) -> Adapter:
        """Read and check the adapter, then register it; LoRAError (nothing registered)
        for a bad adapter or a name in use."""
        if not name:
            raise LoRAError("a LoRA adapter needs a name")
        self._check_room(name)
        rank = self._read_rank(path)  # outside the lock: reads files
        with self._lock:
            self._check_room(name)
            self._ids += 1
            self._adapters[name] = a = Adapter(name, self._ids, str(path), rank)
            return a

    def register_untrusted(self, name: str, path: str, roots: tuple[str, ...]) -> Adapter:
        """`register` for a path from a client (run-time loading): only under `roots`, and
        every failure past that says only that the adapter cannot be loaded, so a client
        learns nothing of the server's files (the reason goes to the log)."""
        if len(name) > 256 or not name.isprintable():
            raise LoRAError("a LoRA adapter name must be 1-256 printable characters")
        self._check_room(name)
        real = allowed_path(path, roots) if roots else None
        if real is None:
            raise LoRAError(f"LoRA adapter {name!r}: run-time loading is limited to the "
                            "directories named by --lora-allowed-dir" if roots else
                            "run-time LoRA loading is off: start with --lora-allowed-dir DIR")
        try:
            return self.register(name, real)
        except NoRoom:
            raise
        except LoRAError as e:
            log.warning("run-time LoRA load of %r from %s failed: %s", name, real, e)
            raise LoRAError(f"LoRA adapter {name!r} cannot be loaded: not a PEFT LoRA "
                            "adapter this model can serve (the server's log says why)") from None

    def _check_room(self, name: str) -> None:
        with self._lock:
            if name in self._adapters:
                raise NoRoom(f"LoRA adapter {name!r} is already loaded")
            if len(self._adapters) >= self.max_adapters:
                raise NoRoom(f"{len(self._adapters)} LoRA adapters are registered, the "
                                "most allowed (--max-lora-adapters): unload one first")

    def unregister(self, name: str) -> None:
        """Forget an idle adapter (its slot, if hot, becomes free); LoRAError while a
        sequence uses it."""
        with self._lock:
            a = self.get(name)
            if a.users:
                raise LoRAError(f"LoRA adapter {name!r} is in use by {a.users} request(s)")
            if a.slot is not None:
                self._slots[a.slot] = None
                self._unpinned.pop(a.slot, None)
            del self._adapters[name]

    def get(self, name: str) -> Adapter:
        with self._lock:
            a = self._adapters.get(name)
            if a is None:
                raise UnknownAdapter(f"the model {name!r} does not exist (no LoRA adapter "
                                     "of that name is loaded)")
            return a

    def open(self, name: str) -> Adapter:
        """A sequence for `name` enters the system (UnknownAdapter if not registered)."""
        with self._lock:
            a = self.get(name)
            a.users += 1
            a.requests += 1
            return a

    def close(self, name: str) -> None:
        """That sequence left (finished, aborted or failed), with its slot released."""
        with self._lock:
            a = self._adapters.get(name)
            if a is not None:
                a.users -= 1

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return list(self._adapters.values())

    # ---- slots (step thread) --------------------------------------------------------
    def acquire(self, name: str) -> Grant | None:
        """A pinned slot for `name`: its own if hot (a hit), else a free one or the least
        recently used unpinned one (to load); None when every slot is pinned."""
        with self._lock:
            a = self.get(name)
            if a.slot is not None:
                self.hits += 1
                self._pin(a.slot)
                return Grant(a.slot, load=False)
            free = [s for s, held in enumerate(self._slots) if held is None]
            if free:
                slot, evicted = free[0], None
            elif self._unpinned:
                slot = next(iter(self._unpinned))
                evicted = self._slots[slot]
                self._adapters[evicted].slot = None
                self.moves["hot", "warm"] += 1
            else:
                return None
            self.misses += 1
            self._slots[slot], a.slot = name, slot
            self._pin(slot)
            return Grant(slot, load=True, evicted=evicted)

    def loaded(self, tier: Tier, seconds: float) -> None:
        """A granted load finished: from the workers' `tier` ("warm" or "cold")."""
        with self._lock:
            self.moves[tier, "hot"] += 1
            self.load_seconds.observe(seconds)
            self.load_times[tier].append(seconds)

    def load_failed(self, slot: int) -> None:
        """A granted load failed (its sequences were failed): the slot is free again (the
        next load into it rewrites it whole), and the adapter takes a new id, so the blocks
        its sequences computed meanwhile, without it, are never reused under its name."""
        with self._lock:
            name = self._slots[slot]
            if name is not None and name in self._adapters:
                self._ids += 1
                a = self._adapters[name]
                a.slot, a.adapter_id = None, self._ids
            self._slots[slot], self._pins[slot] = None, 0
            self._unpinned.pop(slot, None)

    def release(self, slot: int) -> None:
        """A sequence in `slot` finished: unpinned with its last user, most recently used."""
        with self._lock:
            self._pins[slot] -= 1
            if self._pins[slot] == 0 and self._slots[slot] is not None:
                self._unpinned[slot] = None

    def reset(self) -> None:
        """The workers restarted: every slot is empty, no sequence is in the system."""
        with self._lock:
            self._slots = [None] * self.max_loras
            self._pins = [0] * self.max_loras
            self._unpinned.clear()
            for a in self._adapters.values():
                a.slot, a.users = None, 0

    def _pin(self, slot: int) -> None:
        self._pins[slot] += 1
        self._unpinned.pop(slot, None)

    def pinned(self, slot: int) -> int:
        return self._pins[slot]

    def hot(self) -> list[str | None]:
        """Slot -> the adapter it holds."""
        with self._lock:
            return list(self._slots)

    def stats(self) -> dict:
        with self._lock:
            done = self.hits + self.misses
            return {
                "adapters": len(self._adapters), "max_loras": self.max_loras,
                "hot": sum(s is not None for s in self._slots),
                "pinned": sum(p > 0 for p in self._pins),
                "requests": {a.name: a.requests for a in self._adapters.values()},
                "hits": self.hits, "misses": self.misses,
                "hot_hit_rate": round(self.hits / done, 4) if done else 0.0,
                "moves": [[f, t, n] for (f, t), n in sorted(self.moves.items())],
                # as kv_cache's allocate_seconds: counts per bound, the last over every bound
                "load_seconds": {"bounds": list(LOAD_BUCKETS),
                                 "counts": list(self.load_seconds.counts),
                                 "sum": self.load_seconds.sum},
                # the last 10k loads' times by the tier they came from (ms)
                "load_ms": {tier: _percentiles(times) for tier, times in self.load_times.items()},
            }


class LoRAAdmission:
    """Between the event loop's requests and the schedulers: a sequence for an adapter gets
    a pinned slot before it is scheduled, or waits here, in arrival order, until a slot is
    unpinned. A slot granted to load rides on the next step (`take_loads`): the workers
    write it ahead of that step on their device stream, after the step in flight, so
    nothing is flushed. Runs on the step thread."""

    def __init__(self, registry: LoRARegistry) -> None:
        self.registry = registry
        self.waiting: deque[tuple[Sequence, str]] = deque()
        self._names: dict[int, str] = {}  # seq id -> adapter, from admission to release
        self._loads: dict[int, str] = {}  # slot -> adapter path, for the next step

    def admit(self, new: list[tuple[Sequence, str | None]]) -> list[Sequence]:
        """The sequences that may be scheduled now (slots set, their loads queued for the
        next step): the base ones, then those that got a slot, waiting ones first; the rest
        wait."""
        ready = [seq for seq, name in new if name is None]
        queue, self.waiting = self.waiting, deque()
        queue.extend((seq, name) for seq, name in new if name is not None)
        for seq, name in queue:
            grant = self.registry.acquire(name)
            if grant is None:  # every slot pinned: it waits, hot adapters' requests do not
                self.waiting.append((seq, name))
                continue
            a = self.registry.get(name)
            if grant.load:  # a load queued for a slot freed since is superseded
                self._loads[grant.slot] = a.path
            seq.lora_slot, seq.adapter_id = grant.slot, a.adapter_id  # (a failed load's: new)
            self._names[seq.seq_id] = name
            ready.append(seq)
        return ready

    def take_loads(self) -> list[tuple[int, str]]:
        """(slot, path) of the loads granted since the last step, for the step being sent."""
        loads, self._loads = list(self._loads.items()), {}
        return loads

    def loaded(self, reports: list[LoRALoad]) -> list[tuple[int, str]]:
        """Every rank's reports of the loads a step carried: a load is counted once, at the
        slowest rank's time; one that failed on any rank frees its slot and returns its
        admitted sequences, (seq id, error line), for the caller to end."""
        by_slot: dict[int, list[LoRALoad]] = {}
        for r in reports:
            by_slot.setdefault(r.slot, []).append(r)
        failed: list[tuple[int, str]] = []
        for slot, rs in by_slot.items():
            errors = [r.error for r in rs if r.error]
            if not errors:
                self.registry.loaded(rs[0].tier, max(r.seconds for r in rs))
                continue
            name = self.registry.hot()[slot]
            ids = [i for i, n in self._names.items() if n == name]
            for i in ids:
                del self._names[i]
                self.registry.close(name)
            self.registry.load_failed(slot)
            failed += [(i, f"loading LoRA adapter {name!r} failed: {errors[0]}") for i in ids]
        return failed

    def release(self, seq: Sequence) -> None:
        """`seq` finished or was aborted after admission: its slot is unpinned."""
        name = self._names.pop(seq.seq_id, None)
        if name is not None:
            self.registry.release(seq.lora_slot)
            self.registry.close(name)

    def drop(self, seq_id: int) -> bool:
        """Abort a waiting sequence; False if it was not waiting."""
        for i, (seq, name) in enumerate(self.waiting):
            if seq.seq_id == seq_id:
                del self.waiting[i]
                self.registry.close(name)
                return True
        return False

    def reset(self) -> None:
        """The worker group failed: every request was failed, the slots are gone."""
        self.waiting.clear()
        self._names.clear()
        self._loads.clear()
        self.registry.reset()


def _percentiles(seconds: deque[float]) -> dict[str, float | int | None]:
    """count, p50, p90, p99 and max of `seconds`, in ms (nearest rank; None when empty)."""
    s = sorted(seconds)
    pick = (lambda q: round(1e3 * s[min(len(s) - 1, int(q * len(s)))], 4)) if s else (
        lambda q: None)
    return {"count": len(s), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
            "max": pick(1.0)}
