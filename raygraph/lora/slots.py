"""Adapter slots in a built model, and the slot images that load them.

Each projection kind the adapters may target (q|k|v, o, gate|up, down: a module path under
the decoder layer) keeps the slots of every layer in one stacked B [L, max_loras, out_local,
R] and, per layer, A [max_loras, P*R, in_local] in the weight's rows after W's
(append_slot_rows: a decode GEMM computes every slot's shrink). Layer i's LoRAWeights are
views (contiguous, as the kernels want), allocated once: loads never reallocate, so graphs
captured over the slots stay valid.

An adapter is loaded from its slot image: the same layout for one slot, on the host, built
once per adapter (the warm tier keeps it), so a promotion is a copy per layer's A and one
per stacked B.
Under tensor parallelism each rank's image holds its shard, split as the base weight is: a
column-parallel layer (q|k|v, gate|up) splits B by output rows exactly as its part of W (KV
heads replicated included), A whole; a row-parallel layer (o, down) splits A by input
columns and keeps B whole, and its partial delta joins the layer's one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raygraph.config import ConfigError, LoRAConfig
from raygraph.errors import LoRAError
from raygraph.lora.adapter import LoRAAdapter, LoRAModule
from raygraph.model.loader import STACKED
from raygraph.model.lora_ops import LoRAWeights
from raygraph.model.parallel import MergedColumnParallelLinear, RowParallelLinear, load_shard

# HF module -> (raygraph module under the decoder layer, part of a merged projection)
TARGETS: dict[str, tuple[str, int]] = {
    **{name: (("self_attn." if merged == "qkv_proj" else "mlp.") + merged, part)
       for name, (merged, part) in STACKED.items()},
    "o_proj": ("self_attn.o_proj", 0),
    "down_proj": ("mlp.down_proj", 0),
}
Linear = MergedColumnParallelLinear | RowParallelLinear
Stacks = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module path -> (A, B) of every layer
# module path -> (A per layer [max_loras, P*R, in_local], B of every layer)
Slots = dict[str, tuple[list[torch.Tensor], torch.Tensor]]


def _paths(cfg: LoRAConfig) -> list[str]:
    return sorted({TARGETS[name][0] for name in cfg.targets})


def append_slot_rows(model: nn.Module, cfg: LoRAConfig) -> None:
    """Before the weights move to their arena: each targeted layer gets its slots' A rows
    (zeros) after W's rows, so a decode step's GEMM computes every slot's shrink."""
    for path in _paths(cfg):
        for layer in model.model.layers:
            linear = layer.get_submodule(path)
            linear.append_rows(cfg.max_loras * len(_slices(linear)) * cfg.padded_rank)


def _slices(linear: Linear) -> tuple[int, ...]:
    """Each merged part's output rows on this rank (one part: all of W's)."""
    return tuple(getattr(linear, "local_sizes", [linear.out_local]))


@dataclass(frozen=True)
class SlotImage:
    """One adapter as one slot holds it on this rank, on the host (pinned for CUDA): per
    projection kind it touches, A [L, P*R, in_local] and B [L, out_local, R], zeros where it
    lacks a part or a layer, the scaling folded into B."""

    path: str
    stacks: Stacks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.stacks.values() for t in ab)


class LoRASlots:
    """A model's adapter slots (`cfg.max_loras` of rank `cfg.padded_rank`, zero at first) on
    the projections `cfg.targets` reach; the others keep their plain kernels."""

    def __init__(self, model: nn.Module, cfg: LoRAConfig) -> None:
        if getattr(model.config, "num_experts", 0):
            raise ConfigError("LoRA adapters need a dense model; "
                              f"{model.config.architecture} has MoE layers")
        self.layers = model.model.layers
        self.num_slots, self.rank = cfg.max_loras, cfg.padded_rank
        self.stacks: Slots = {}
        for path in _paths(cfg):
            first = self.layers[0].get_submodule(path)
            slices, w = _slices(first), first.weight
            rows = len(slices) * self.rank
            b = torch.zeros(len(self.layers), cfg.max_loras, sum(slices), self.rank,
                            dtype=w.dtype, device=w.device)
            parts = tuple(sorted({TARGETS[n][1] for n in cfg.targets if TARGETS[n][0] == path}))
            a_layers = []
            for i, layer in enumerate(self.layers):
                linear = layer.get_submodule(path)  # A: the weight's rows after W's
                a = linear.weight[linear.out_local:].view(cfg.max_loras, rows, w.shape[1])
                linear.lora = LoRAWeights(a, b[i], slices, parts)
                a_layers.append(a)
            self.stacks[path] = (a_layers, b)
        self._held: list[set[str]] = [set() for _ in range(cfg.max_loras)]  # not zero there
        self._images: list[SlotImage | None] = [None] * cfg.max_loras  # what each slot holds
        self._copying: list[tuple[torch.cuda.Event, SlotImage]] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for a, b in self.stacks.values() for t in (*a, b))

    def check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise LoRAError(f"adapter slot {slot} is out of range [0, {self.num_slots})")

    def image(self, adapter: LoRAAdapter, pin: bool) -> SlotImage:
        """`adapter` in one slot's layout, this rank's shard, on the host."""
        if adapter.rank > self.rank:
            raise LoRAError(f"LoRA adapter {adapter.path!r}: rank {adapter.rank} is over the "
                            f"slots' rank {self.rank}")
        stacks: Stacks = {}
        for i, modules in adapter.layers.items():
            for name, m in modules.items():
                path, part = TARGETS[name]
                if path not in self.stacks:
                    raise LoRAError(f"LoRA adapter {adapter.path!r}: {name} has no slots")
                if path not in stacks:
                    a_layers, b_all = self.stacks[path]
                    stacks[path] = tuple(torch.zeros(shape, dtype=b_all.dtype, pin_memory=pin)
                                         for shape in ((len(a_layers), *a_layers[0].shape[1:]),
                                                       b_all.shape[:1] + b_all.shape[2:]))
                a, b = stacks[path]
                _write(self.layers[i].get_submodule(path), a[i], b[i], part, m, adapter.path)
        return SlotImage(adapter.path, stacks)

    def load(self, slot: int, image: SlotImage) -> None:
        """Copy `image` into `slot`, queued on the current stream (from pinned memory: the
        host does not wait); kinds the image lacks are zeroed unless already zero. Stream
        order puts the copies after the steps queued before and ahead of those after."""
        self.check(slot)
        self._images[slot] = image
        for path, (a_layers, b) in self.stacks.items():
            src = image.stacks.get(path)
            if src is not None:
                self._held[slot].add(path)
                for a, a_src in zip(a_layers, src[0]):
                    a[slot].copy_(a_src, non_blocking=True)
                b[:, slot].copy_(src[1], non_blocking=True)
            elif path in self._held[slot]:
                for a in a_layers:
                    a[slot].zero_()
                b[:, slot].zero_()
                self._held[slot].discard(path)
        if b.is_cuda:
            # the pinned image stays referenced until its copies ran (the warm tier may drop it)
            self._copying = [(e, im) for e, im in self._copying if not e.query()]
            done = torch.cuda.Event()
            done.record()
            self._copying.append((done, image))

    def clear(self, slot: int) -> None:
        """Zero `slot` everywhere: its tokens then compute the base model."""
        self.check(slot)
        for a_layers, b in self.stacks.values():
            for a in a_layers:
                a[slot].zero_()
            b[:, slot].zero_()
        self._held[slot].clear()
        self._images[slot] = None

    def restore(self) -> None:
        """Every slot written again as it was (its image, or zeros): after a level-2 wake the
        A rows kept in the weights' arena come back as they were at the arena's first
        sleep."""
        for slot, image in enumerate(self._images):
            if image is not None:
                self.load(slot, image)
            else:
                self.clear(slot)


def _write(linear: Linear, a_dst: torch.Tensor, b_dst: torch.Tensor, part: int, m: LoRAModule,
           path: str) -> None:
    """This rank's shard of one module `m` into one slot's A [P*R, in_local] and B
    [out_local, R] of `linear` (`part` of it), in their dtype."""
    r, rank, dtype = m.a.shape[0], b_dst.shape[1], a_dst.dtype
    a = m.a.to(dtype)
    b = m.b if m.scaling == 1.0 and m.b.dtype == dtype else (m.b.float() * m.scaling).to(dtype)
    if isinstance(linear, RowParallelLinear):  # A split on input columns, B whole
        _check_full(linear.out_local, linear.weight.shape[1] * linear.comm.world_size, m, path)
        load_shard(a_dst[:r], a, 1, linear.comm)
        b_dst[:, :r].copy_(b)
    else:  # A whole (this part's rank rows), B split on output rows as the part of W
        out_f, in_f = linear.part_shape(part, linear.weight)
        _check_full(out_f, in_f, m, path)
        a_dst[part * rank: part * rank + r].copy_(a)
        linear.load_part(b_dst[:, :r], b, part)


def _check_full(out_f: int, in_f: int, m: LoRAModule, path: str) -> None:
    """The adapter was checked against a ModelConfig; this is the layer it lands in."""
    if (m.b.shape[0], m.a.shape[1]) != (out_f, in_f):
        raise LoRAError(f"LoRA adapter {path!r}: a {m.a.shape[1]} -> {m.b.shape[0]} "
                        f"projection does not fit the layer's {in_f} -> {out_f}")
