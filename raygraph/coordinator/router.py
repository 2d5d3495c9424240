"""Which replica a request goes to: pure Python, kept by every process that sends requests
to engines (the coordinator for Ray calls, each HTTP server for its own streams).

Cache routing sends a prompt to the home of the longest block-aligned prefix of it: the
replica that prefix was first sent to, where it is likely still cached. A home that is
overloaded is passed over: more than `max_imbalance` times the least loaded replica's
outstanding tokens and more than `balance_tokens` above them (both, as SGLang's cache-aware
router bounds it: at low load a few requests must not scatter a prefix over every
replica). The request then goes, as in load routing, to the less loaded of two replicas
picked at random, and the prefix keeps its home: a burst does not move (and recompute)
every busy prefix. A home that is down is replaced by the next replica sent the prefix.
A LoRA request's prefixes start with its adapter (prefix_hashes), so an adapter's requests
go where it was sent before, where it is likely loaded in a slot.

Replicas past `ReplicaConfig.awake` are elastic: a request goes to them only while every
awake replica has `spill_at` (its batch's worth of) requests of this router outstanding, so
an elastic replica that saw no request for a while sleeps (engine/engine.py) and a burst
wakes it.

Load is the tokens this router has outstanding on each replica (prompt + max_tokens of every
request not finished), so each router sees only its own traffic: a bounded approximation of
the engines' real state that needs no message per step. The prefix map is an LRU of block
hashes, `max_prefixes` long.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from raygraph.config import ReplicaConfig

# a text prompt is hashed in blocks of this many characters (roughly a token block)
TEXT_BLOCK_CHARS = 64
# routed traffic is remembered over about this many requests (exponential decay)
WINDOW = 256


def prefix_hashes(prompt: str | Sequence[int] | bytes, block: int,
                  adapter: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks: entry i identifies blocks 0..i, so two
    prompts share entry i exactly when they share their first i + 1 blocks. A LoRA
    adapter's prompts chain from a first entry of their own (the adapter alone): they share
    prefixes only with prompts of the same adapter, whose KV is the one they can reuse, and
    even a prompt shorter than a block has a home, where its adapter is loaded."""
    if isinstance(prompt, bytes):  # packed uint32 ids (raygraph.requests.pack_ids)
        block *= 4
    elif isinstance(prompt, str):
        block = TEXT_BLOCK_CHARS
    else:
        prompt = tuple(prompt)
    h = 0 if adapter is None else hash(("lora", adapter))
    out: list[int] = [] if adapter is None else [h]
    for start in range(0, len(prompt) - block + 1, block):
        h = hash((h, prompt[start:start + block]))
        out.append(h)
    return out


class Router:
    def __init__(self, replicas: int, cfg: ReplicaConfig, block_size: int, spill_at: int,
                 rng: random.Random | None = None) -> None:
        """`spill_at`: a replica's batch (max_num_seqs x DP groups), past which elastic
        replicas take requests too."""
        self.cfg = cfg
        self.block_size = block_size
        self.spill_at = spill_at
        self.load = [0] * replicas  # outstanding tokens per replica
        self.requests = [0] * replicas  # outstanding requests per replica
        self.up = [True] * replicas  # replicas that take requests
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # block hash -> replica
        self.rng = rng or random.Random()
        self._next = 0  # round-robin position
        self.hits = 0  # requests sent to the replica holding a prefix of theirs
        self.moves = 0  # prefixes moved to balance the routed traffic
        # decayed tokens routed per replica and through each prefix (block hash), in
        # units that grow by 1/(1 - 1/WINDOW) a request instead of decaying every entry
        self.routed = [0.0] * replicas
        self.traffic: dict[int, float] = {}
        self._unit = 1.0

    def resize(self, replicas: int) -> None:
        """More or fewer replicas (scaling): new ones start unloaded; prefixes that point
        past the end are forgotten as they are met."""
        self.load = (self.load + [0] * replicas)[:replicas]
        self.requests = (self.requests + [0] * replicas)[:replicas]
        self.up = (self.up + [True] * replicas)[:replicas]
        self.routed = (self.routed + [0.0] * replicas)[:replicas]

    def set_up(self, replica: int, up: bool) -> None:
        """A replica that failed (or sleeps) takes no requests until it is up again."""
        self.up[replica] = up

    def pick(self, prompt: str | Sequence[int] | bytes, cost: int,
             adapter: str | None = None) -> int:
        """The replica for a prompt that will cost `cost` tokens (with LoRA `adapter`); it
        counts as outstanding there until `done`. ValueError when no replica is up."""
        live = self._admitting()
        policy = self.cfg.routing
        if policy == "round-robin":
            choice = live[self._next % len(live)]
            self._next += 1
        else:
            hashes = (prefix_hashes(prompt, self.block_size, adapter) if policy == "cache"
                      else [])
            matched, choice = self._cached(hashes, live, cost)
            home = choice is not None  # the prompt follows (or now moves) its prefix
            if choice is None:
                choice = self._least_of_two(live)
            elif (to := self._rebalanced(choice, matched, live)) is not None:
                choice = to
                self.moves += 1
            else:
                self.hits += 1
            for h in hashes:  # blocks nobody holds (or a replica that is down held) now live
                owner = self.prefixes.get(h)  # there; an overflow keeps its prefix's home
                if home or owner is None or owner not in live:
                    self.prefixes[h] = choice
                self.prefixes.move_to_end(h)
            while len(self.prefixes) > self.cfg.max_prefixes:
                self.traffic.pop(self.prefixes.popitem(last=False)[0], None)
            self._count(choice, hashes, cost)
        self.load[choice] += cost
        self.requests[choice] += 1
        return choice

    def _admitting(self) -> list[int]:
        """The replicas a request may go to: the awake ones that are up, unless each has a
        batch of requests outstanding (then the elastic ones too). ValueError when none."""
        live = [r for r, ok in enumerate(self.up) if ok]
        if not live:
            raise ValueError("no replica is serving")
        n = len(self.up) if self.cfg.min_replicas is None else self.cfg.min_replicas
        awake = [r for r in live if r < n]
        if any(self.requests[r] < self.spill_at for r in awake):
            return awake
        return live

    def _cached(self, hashes: list[int], live: list[int], cost: int
                ) -> tuple[int | None, int | None]:
        """(the longest prefix hash a live replica holds, that replica), the replica None
        when it is overloaded; (None, None) without a prefix."""
        floor = min(self.load[r] for r in live)
        for h in reversed(hashes):  # the longest prefix first
            r = self.prefixes.get(h)
            if r is None or r not in live:
                continue
            load = self.load[r] + cost
            overloaded = (load > self.cfg.max_imbalance * floor
                          and load - floor > self.cfg.balance_tokens)
            return h, None if overloaded else r  # overloaded: balance instead
        return None, None

    def _rebalanced(self, home: int, matched: int | None, live: list[int]) -> int | None:
        """The replica the prefix `matched` should move to from `home`, or None to stay."""
        least = min(live, key=self.routed.__getitem__)
        gap = self.routed[home] - self.routed[least]
        mean = sum(self.routed[r] for r in live) / len(live)
        if gap <= self.cfg.rebalance_gap * mean or self.traffic.get(matched, 0.0) >= gap:
            return None
        return least

    def _count(self, replica: int, hashes: list[int], cost: int) -> None:
        """Add a request's tokens to the decayed traffic of its replica and of every prefix
        of its prompt (a prefix's traffic: all requests that share it)."""
        self._unit /= 1.0 - 1.0 / WINDOW
        if self._unit > 1e100:  # rescale before floats run out
            self.routed = [v / self._unit for v in self.routed]
            self.traffic = {h: v / self._unit for h, v in self.traffic.items()}
            self._unit = 1.0
        add = cost * self._unit
        self.routed[replica] += add
        traffic = self.traffic
        for h in hashes:
            traffic[h] = traffic.get(h, 0.0) + add

    def _least_of_two(self, live: list[int]) -> int:
        if len(live) == 1:
            return live[0]
        a, b = self.rng.sample(live, 2)  # ties (say, nothing outstanding): routed less
        return min((a, b), key=lambda r: (self.load[r], self.routed[r]))

    def done(self, replica: int, cost: int) -> None:
        """A request picked with `cost` finished (or failed) on `replica`."""
        if replica < len(self.load):
            self.load[replica] = max(0, self.load[replica] - cost)
            self.requests[replica] = max(0, self.requests[replica] - 1)
