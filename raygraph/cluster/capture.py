"""Background capture: the capture schedule runs between served steps, busiest shapes first.

The coordinator serves as soon as the weights and the KV cache are ready. Until a key is
captured on every rank (lockstep, cluster/lockstep.py), steps of that key run eagerly on
every rank: the step message names the eager key, so ranks never disagree about which keys
replay. Keys are taken in order of the traffic seen so far (the decode batch sizes being
served before a large prefill bucket nobody asked for), then the rest of the schedule:
decode before prefill, small before large. Under load, capture takes at most `share` of the
step thread's time: after a capture of c seconds, steps run for c * (1 - share) / share
seconds before the next one; with nothing to serve, keys are captured back to back.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from raygraph.protocol import BucketKey


def _rest_order(key: BucketKey) -> tuple[int, int, int]:
    return (key.phase != "decode", key.num_tokens, key.num_comm_tokens)


class BackgroundCapture:
    def __init__(self, schedule: Iterable[BucketKey], share: float) -> None:
        """`share`: GraphConfig.capture_share."""
        if not 0 < share <= 1:
            raise ValueError(f"the capture share of the step thread must be in (0, 1], "
                             f"got {share}")
        self.pending: list[BucketKey] = sorted(schedule, key=_rest_order)
        self.total = len(self.pending)
        self.share = share
        self.seen: Counter[BucketKey] = Counter()  # steps run eagerly, per key not captured
        self.eager_steps = 0
        self.capture_s = 0.0
        self.started = time.perf_counter()
        self.finished_at: float | None = None  # perf_counter when the last key was captured
        self._next_at = 0.0  # under load, no capture before this perf_counter

    @property
    def done(self) -> bool:
        return not self.pending

    @property
    def captured(self) -> int:
        return self.total - len(self.pending)

    def missed(self, key: BucketKey) -> None:
        """A step of `key` ran eagerly because it is not captured yet: it moves up the queue.
        A key outside the schedule (an EP pair of unbalanced loads) joins it."""
        if key not in self.pending:
            self.pending.append(key)
            self.total += 1
            self.finished_at = None
        self.seen[key] += 1
        self.eager_steps += 1

    def due(self, busy: bool, now: float | None = None) -> bool:
        """Whether to capture a key now: always when idle, under load once the steps since
        the last capture have had their share of the time."""
        if not self.pending:
            return False
        return not busy or (time.perf_counter() if now is None else now) >= self._next_at

    def next_key(self) -> BucketKey:
        """The most-missed key not captured yet; without traffic, the schedule's order."""
        busiest = max(self.pending, key=lambda k: self.seen[k], default=None)
        if busiest is not None and self.seen[busiest]:
            return busiest
        return self.pending[0]

    def captured_key(self, key: BucketKey, seconds: float, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.pending.remove(key)
        self.seen.pop(key, None)
        self.capture_s += seconds
        self._next_at = now + seconds * (1 - self.share) / self.share
        if not self.pending:
            self.finished_at = now
