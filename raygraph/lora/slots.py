"""Adapter slots in a built model: the stacked A/B tensors every LoRA-enabled projection
holds (allocated once), and the in-place writes that load or clear one slot.

Writes never reallocate, so graphs captured over the slots stay valid. Under tensor
parallelism each rank writes its shard, split as the base weight is: a column-parallel
layer (q|k|v, gate|up) splits B by output rows exactly as its part of W (KV heads
replicated included), A whole; a row-parallel layer (o, down) splits A by input columns and
keeps B whole, and its partial delta joins the layer's one all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from raygraph.config import ConfigError, LoRAConfig
from raygraph.lora.adapter import LoRAAdapter, LoRAError, LoRAModule
from raygraph.model.loader import STACKED
from raygraph.model.lora_ops import LoRAWeights, num_lora_slots
from raygraph.model.parallel import MergedColumnParallelLinear, RowParallelLinear, load_shard

# HF module -> (raygraph module under the decoder layer, part of a merged projection)
TARGETS: dict[str, tuple[str, int]] = {
    **{name: (("self_attn." if merged == "qkv_proj" else "mlp.") + merged, part)
       for name, (merged, part) in STACKED.items()},
    "o_proj": ("self_attn.o_proj", 0),
    "down_proj": ("mlp.down_proj", 0),
}
Linear = MergedColumnParallelLinear | RowParallelLinear


def lora_linears(model: nn.Module, targets: tuple[str, ...] | None = None
                 ) -> Iterator[tuple[int, str, Linear]]:
    """(layer, raygraph module path, module) of every projection with a part among the HF
    modules `targets` (None: those given slots by `enable_lora`)."""
    names = targets or TARGETS
    paths = sorted({TARGETS[name][0] for name in names})
    for i, layer in enumerate(model.model.layers):
        for path in paths:
            linear = layer.get_submodule(path)
            if targets is not None or linear.lora is not None:
                yield i, path, linear


def enable_lora(model: nn.Module, cfg: LoRAConfig) -> int:
    """Give each projection the adapters may target (`cfg.targets`: q|k|v if any of q, k,
    v; o; gate|up; down) `cfg.max_loras` empty (zero) slots of rank `cfg.padded_rank`, on
    the weights' device and dtype; the others keep their plain kernels. Returns the bytes
    taken."""
    if getattr(model.config, "num_experts", 0):
        raise ConfigError("LoRA adapters need a dense model; "
                          f"{model.config.architecture} has MoE layers")
    r, total = cfg.padded_rank, 0
    for _, _, linear in lora_linears(model, cfg.targets):
        w = linear.weight
        slices = tuple(getattr(linear, "local_sizes", [w.shape[0]]))
        a = torch.zeros(cfg.max_loras, len(slices) * r, w.shape[1], dtype=w.dtype,
                        device=w.device)
        b = torch.zeros(cfg.max_loras, w.shape[0], r, dtype=w.dtype, device=w.device)
        linear.lora = LoRAWeights(a, b, slices)
        total += (a.numel() + b.numel()) * a.element_size()
    return total


def _check_slot(model: nn.Module, slot: int) -> None:
    slots = num_lora_slots(model)
    if not slots:
        raise LoRAError("LoRA is off (lora.max_loras = 0): no adapter slots")
    if not 0 <= slot < slots:
        raise LoRAError(f"adapter slot {slot} is out of range [0, {slots})")


@torch.no_grad()
def clear_slot(model: nn.Module, slot: int) -> None:
    """Zero one slot: its tokens then compute the base model."""
    _check_slot(model, slot)
    for _, _, linear in lora_linears(model):
        linear.lora.a[slot].zero_()
        linear.lora.b[slot].zero_()


@torch.no_grad()
def load_adapter_into_slot(model: nn.Module, slot: int, adapter: LoRAAdapter) -> None:
    """Write this rank's shard of `adapter` into `slot`, in place (what the slot held before
    is cleared: projections the adapter lacks compute the base model)."""
    _check_slot(model, slot)
    rank = slot_rank(model)
    if adapter.rank > rank:
        raise LoRAError(f"LoRA adapter {adapter.path!r}: rank {adapter.rank} is over the "
                        f"slots' rank {rank}")
    clear_slot(model, slot)
    layers = model.model.layers
    for i, modules in adapter.layers.items():
        for name, m in modules.items():
            path, part = TARGETS[name]
            _write(layers[i].get_submodule(path), slot, part, m, adapter.path)


def slot_rank(model: nn.Module) -> int:
    """The slots' (padded) rank."""
    return next(linear.lora.rank for _, _, linear in lora_linears(model))


def _write(linear: Linear, slot: int, part: int, m: LoRAModule, path: str) -> None:
    w = linear.lora
    r, dtype = m.a.shape[0], w.a.dtype
    a = m.a.to(dtype)
    # the scaling folded into B, once (the warm tier holds it folded, in the slots' dtype)
    b = m.b if m.scaling == 1.0 and m.b.dtype == dtype else (m.b.float() * m.scaling).to(dtype)
    if isinstance(linear, RowParallelLinear):  # A split on input columns, B whole
        _check_full(linear.weight.shape[0], linear.weight.shape[1] * linear.comm.world_size,
                    m, path)
        load_shard(w.a[slot, :r], a, 1, linear.comm)
        w.b[slot, :, :r].copy_(b)
    else:  # A whole (this part's rank rows), B split on output rows as the part of W
        out_f, in_f = linear.part_shape(part, linear.weight)
        _check_full(out_f, in_f, m, path)
        w.a[slot, part * w.rank: part * w.rank + r].copy_(a)
        linear.load_part(w.b[slot, :, :r], b, part)


def _check_full(out_f: int, in_f: int, m: LoRAModule, path: str) -> None:
    """The adapter was checked against a ModelConfig; this is the layer it lands in."""
    if (m.b.shape[0], m.a.shape[1]) != (out_f, in_f):
        raise LoRAError(f"LoRA adapter {path!r}: a {m.a.shape[1]} -> {m.b.shape[0]} "
                        f"projection does not fit the layer's {in_f} -> {out_f}")
