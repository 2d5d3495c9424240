"""The warm tier: recently loaded adapters kept in host memory on each worker, already in
the slots' dtype with the scaling folded into B and pinned when the slots are on CUDA, so
promoting one into a slot is a host-to-device copy instead of reading files."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from raygraph.lora.adapter import WEIGHTS_FILE, LoRAAdapter, LoRAModule

Key = tuple[str, int, int]  # (path, weights file mtime ns, size): files changed -> a new key


class WarmAdapters:
    def __init__(self, budget_bytes: int, dtype: torch.dtype, pin: bool) -> None:
        self.budget_bytes = budget_bytes
        self.dtype = dtype
        self.pin = pin
        self.bytes = 0
        self._lru: OrderedDict[Key, tuple[LoRAAdapter, int]] = OrderedDict()

    def get(self, path: str, read: Callable[[str], LoRAAdapter]) -> tuple[LoRAAdapter, str]:
        """The adapter at `path` and the tier it came from: "warm" (held here) or "cold"
        (read with `read`, then held here if it fits the budget, least recent evicted)."""
        st = (Path(path) / WEIGHTS_FILE).stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key in self._lru:
            self._lru.move_to_end(key)
            return self._lru[key][0], "warm"
        adapter = self._host_form(read(path))
        size = sum(t.numel() * t.element_size() for mods in adapter.layers.values()
                   for m in mods.values() for t in (m.a, m.b))
        if size <= self.budget_bytes:
            while self.bytes + size > self.budget_bytes:
                self.bytes -= self._lru.popitem(last=False)[1][1]
            self._lru[key] = (adapter, size)
            self.bytes += size
        return adapter, "cold"

    def _host_form(self, adapter: LoRAAdapter) -> LoRAAdapter:
        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self.dtype).contiguous()
            return t.pin_memory() if self.pin else t

        layers = {i: {name: LoRAModule(host(m.a), host(m.b.float() * m.scaling), 1.0)
                      for name, m in mods.items()} for i, mods in adapter.layers.items()}
        return LoRAAdapter(adapter.path, adapter.rank, layers)
