"""The warm tier: recently loaded adapters kept in host memory on each worker as slot images
(lora/slots.py: this rank's shard, in the slots' layout and dtype, the scaling folded in,
pinned when the slots are on CUDA), so promoting one into a slot is a few host-to-device
copies instead of reading files and cutting shards."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from raygraph.adapter_files import WEIGHTS_FILE
from raygraph.lora.slots import SlotImage

Key = tuple[str, int, int]  # (path, weights file mtime ns, size): files changed -> a new key


class WarmAdapters:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._lru: OrderedDict[Key, SlotImage] = OrderedDict()

    def get(self, path: str, build: Callable[[str], SlotImage]) -> tuple[SlotImage, str]:
        """The slot image of the adapter at `path` and the tier it came from: "warm" (held
        here) or "cold" (built with `build`, then held here if it fits the budget, least
        recent evicted)."""
        st = (Path(path) / WEIGHTS_FILE).stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key in self._lru:
            self._lru.move_to_end(key)
            return self._lru[key], "warm"
        image = build(path)
        if image.nbytes <= self.budget_bytes:
            while self.bytes + image.nbytes > self.budget_bytes:
                self.bytes -= self._lru.popitem(last=False)[1].nbytes
            self._lru[key] = image
            self.bytes += image.nbytes
        return image, "cold"
