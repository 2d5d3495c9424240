"""Ring mode: every offloaded weight has a fixed address, so the forward, copies included,
is captured into the executor's graphs.

The access order is static, so offload_plan.ring_plan places each access once, at load:
copy j waits for the last kernel that read the bytes it overwrites (an event from the
compute stream) and the kernel of j waits for copy j (an event from the copy stream).
What the budget holds beyond the ring keeps weights resident for good (split_ring).

Streams: the copy stream forks from the compute stream at the body's start and joins it
at the body's end, at the end of the last access, and around every piecewise split
(captures must not leave a forked stream behind). Events recorded before a join are never
waited on again: the join/fork pair already orders them ("epochs").
"""

from __future__ import annotations

import torch

from raygraph.memory.offload_engine import OffloadEngine, region_view
from raygraph.memory.offload_plan import OffloadError, aligned, ring_plan, split_ring
from raygraph.model.context import get_forward_context


class RingEngine(OffloadEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        sizes = [s.nbytes for s in self.specs]
        kept, ring_bytes = split_ring(sizes, self.capacity)
        self.kept = set(kept)
        self.ring = [j for j in range(self.n) if j not in self.kept]
        plan = ring_plan([sizes[j] for j in self.ring], ring_bytes)
        used = ring_bytes + sum(aligned(sizes[j]) for j in kept)
        self.region = torch.empty(max(used, 1), dtype=torch.uint8, device=self.device)
        self.wait_for: dict[int, int] = {}
        self.issue_at: dict[int, list[int]] = {}
        self.slots: list[torch.Tensor | None] = [None] * self.n
        for j, slot in zip(self.ring, plan):
            self.slots[j] = region_view(self.region, slot.offset, self.specs[j])
            self.wait_for[j] = self.ring[slot.wait_for] if slot.wait_for >= 0 else -1
            after = self.ring[slot.issue_after] if slot.issue_after >= 0 else -1
            self.issue_at.setdefault(after, []).append(j)
        offset = ring_bytes
        for j in kept:
            view = region_view(self.region, offset, self.specs[j])
            view.copy_(self.host[j])
            self.slots[j] = view
            offset += aligned(self.specs[j].nbytes)
        self.epoch = 0
        self.live = False
        self.copy_epoch = [-1] * self.n
        self.compute_epoch = [-1] * self.n

    def copied_per_step(self) -> int:
        return sum(self.specs[j].nbytes for j in self.ring)

    def _fork(self) -> None:
        self.streams.fork()
        self.epoch += 1
        self.live = True

    def _join(self) -> None:
        if self.live:
            self.streams.join()
            self.live = False
            self.epoch += 1

    def _issue(self, j: int) -> None:
        if not self.live:
            self._fork()
        k = self.wait_for[j]
        after = [k] if k >= 0 and self.compute_epoch[k] == self.epoch else []
        self.streams.copy_in(self.slots[j], self.host[j], j, after)
        self.copy_epoch[j] = self.epoch

    def _begin(self) -> None:
        super()._begin()
        self._fork()
        ctx = get_forward_context()
        if ctx.split is not None and not getattr(ctx.split, "joins_offload", False):
            inner = ctx.split

            def split(*args):
                self._close()
                out = inner(*args)
                self._fork()
                return out

            split.joins_offload = True
            ctx.split = split
        for j in self.issue_at.get(-1, []):
            self._issue(j)

    def _close(self) -> None:
        super()._close()
        self._join()

    def _enter(self, j: int) -> torch.Tensor:
        if j not in self.kept:
            if self.copy_epoch[j] < 0:
                raise OffloadError(f"weight {self.names[j]!r} was read before its copy was "
                                   "issued")
            if self.copy_epoch[j] == self.epoch:
                with self.stall.measure():
                    self.streams.wait_copied(j)
        return self.slots[j]

    def _retire(self, j: int) -> None:
        if j not in self.kept:
            self.streams.mark_computed(j)
            self.compute_epoch[j] = self.epoch
        for i in self.issue_at.get(j, []):
            self._issue(i)
