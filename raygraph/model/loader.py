"""HF checkpoint loading: config.json + *.safetensors (single file or sharded index),
each rank reading only its own slice of every tensor, and the same checkpoint checked from
its headers alone in the driver before any worker starts (`check_checkpoint`). Dummy weights
(`init_dummy_weights`) take the same slicing path from tensors drawn on the device."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from zlib import crc32

import msgspec
import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from raygraph.config import ConfigError, ModelConfig, check_ep
from raygraph.model.checkpoint import CheckpointError, StoredTensor, read_headers
from raygraph.model.eagle3 import Eagle3Head
from raygraph.model.llama import LlamaForCausalLM
from raygraph.model.moe import MoeForCausalLM
from raygraph.model.parallel import Comm, LoRARows, RowParallelLinear, load_shard
from raygraph.model.quant import (
    FP8,
    add_kv_scales,
    local_group,
    make_fp8,
    quantize_layer,
    scale_rows,
    stored_scale_shape,
)
from raygraph.quantization import ONLINE, QuantConfig

# rotary tables; an EAGLE-3 head's target -> draft vocabulary mask (its d2t is what it reads)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "t2d")
DUMMY_STD = 0.02  # HF's initializer_range: activations stay O(1) through every layer
# dummy weights under --quantization fp8: drawn in the layout of an FP8-dynamic checkpoint
DUMMY_FP8 = QuantConfig("compressed-tensors", "channel", "dynamic")


def build_model(
    cfg: ModelConfig, comm: Comm, dtype: torch.dtype, device: torch.device,
    ep_comm: Comm | None = None, progress: Callable[[int, int], None] | None = None,
    load_format: Literal["auto", "dummy"] = "auto",
) -> nn.Module:
    """Construct the model on `device` and load this rank's shard of the checkpoint (under
    `load_format` "dummy": of random weights, see `init_dummy_weights`).

    `comm` is the TP group (attention, dense MLPs, shared experts; experts too without EP);
    `ep_comm`, for MoE models, the expert-parallel group that owns the experts between it.
    """
    if load_format == "dummy" and cfg.quant is not None:  # random FP8 weights and scales
        cfg = msgspec.structs.replace(cfg, quant=DUMMY_FP8)
    # parameters on meta first: FP8 layers then take their FP8 bytes only, never a
    # model-dtype copy (a 70B FP8 checkpoint fits one 141 GB GPU; in bf16 it would not)
    with torch.device(device), _ParametersOnMeta():
        model = _new_model(cfg, comm, ep_comm, load_format)
    model.to(dtype=dtype)
    for module in model.modules():  # rotary tables stay fp32
        if hasattr(module, "cos"):
            module.float()
    online = cfg.quant == ONLINE
    if not online:
        _make_fp8(model, comm.world_size, torch.device(device))
    _materialize(model, torch.device(device))
    if load_format == "dummy":
        init_dummy_weights(model, comm, progress)
    else:
        load_weights(model, cfg.path, comm, progress)
    if online:
        for layer in _fp8_layers(model):
            quantize_layer(layer)
    return model.eval()


def _new_model(cfg: ModelConfig, comm: Comm, ep_comm: Comm | None = None,
               load_format: str = "auto") -> nn.Module:
    check_ep(cfg, ep_comm.world_size if ep_comm else 1, comm.world_size)
    if cfg.family == "eagle3":  # its own embedding only where the checkpoint has one
        own = load_format != "dummy" and any(
            "embed_tokens.weight" in tensors for _, tensors in read_headers(cfg.path))
        return Eagle3Head(cfg, comm, own_embedding=own)
    if cfg.num_experts:
        return MoeForCausalLM(cfg, comm, ep_comm)
    return LlamaForCausalLM(cfg, comm)


def check_checkpoint(cfg: ModelConfig,
                     headers: list[tuple[Path, dict[str, StoredTensor]]] | None = None) -> None:
    """Check the checkpoint against the model `cfg` describes from its headers alone (no tensor
    data is read; `headers`: read_headers(cfg.path) if read already), in the driver before any
    worker starts: every tensor the model needs present, with its full (unsharded) shape."""
    headers = read_headers(cfg.path) if headers is None else headers
    # no parameter shape depends on the positions: rotary tables of one position will do
    with _ParametersOnMeta():
        model = _new_model(msgspec.structs.replace(cfg, max_position_embeddings=1), Comm())
        if cfg.quant != ONLINE:
            _make_fp8(model, 1, torch.device("meta"))
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Part]] = set()
    for file, tensors in headers:
        for ckpt_name, stored in tensors.items():
            slot = _slot(model, params, 1, ckpt_name, file)
            if slot is not None:
                _check_shape(ckpt_name, file, stored, slot)
                loaded.add((slot.name, slot.part))
    _check_complete(model, params, loaded, cfg.path)


class _ParametersOnMeta(TorchFunctionMode):
    """A model's shapes without its memory: tensors made by torch.empty or torch.ones with no
    device (its parameters) are made on meta, the rest (its rotary tables) where asked.
    Building it all on meta would load torch's Python meta kernels for the rotary math, a
    second or more: longer than the whole check."""

    def __torch_function__(self, func: Callable[..., Any], types: tuple[type, ...],
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.empty, torch.ones) and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _fp8_layers(model: nn.Module) -> list[LoRARows]:
    """The linear layers held in FP8 under the model's QuantConfig: every decoder projection
    whose HF modules the config does not ignore (fused parts must agree)."""
    quant = model.config.quant
    if quant is None:
        return []
    out = []
    for name, layer in model.named_modules():
        if not isinstance(layer, LoRARows):
            continue
        parts = range(len(layer.local_sizes)) if hasattr(layer, "local_sizes") else [None]
        hf = [_hf_name(f"{name}.weight", p).removesuffix(".weight") for p in parts]
        ignored = [quant.ignores(n) for n in hf]
        if any(ignored) and not all(ignored):
            raise ConfigError(f"the quantization config ignores only some of {hf}, which "
                              "raygraph runs as one GEMM")
        if not any(ignored):
            out.append(layer)
    return out


def _make_fp8(model: nn.Module, world: int, device: torch.device) -> None:
    """FP8 weights and scales on `device`, for the checkpoint to fill, in the layers
    `_fp8_layers` names; attention k/v scales where the checkpoint has them."""
    quant = model.config.quant
    for layer in _fp8_layers(model):
        in_local = layer.weight.shape[1]
        in_full = in_local * world if isinstance(layer, RowParallelLinear) else in_local
        make_fp8(layer, local_group(quant, in_full, in_local), quant.activations, device)
    if quant is not None and quant.kv_scales:
        for attention in model.attention_layers():
            add_kv_scales(attention, device)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Every parameter still on meta made (uninitialised: the checkpoint fills it) on
    `device`, in its dtype; a tied parameter stays one."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=False)
            setattr(module, name, made[id(p)])


# HF projections that raygraph stacks into one GEMM: name -> (merged name, part)
STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# MoE experts.N.<proj>.weight -> (stacked expert parameter, projection); Mixtral says w1/w3/w2
EXPERT_PROJ = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0),
}
# a part of a merged parameter: an int, or (expert, projection) for stacked experts
Part = int | tuple[int, int] | None


def _target(name: str) -> tuple[str, Part]:
    """Checkpoint tensor name -> (parameter name, part of a merged parameter or None)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
    if name.startswith("layers.0."):  # a `speculators` EAGLE-3 head's layer: its midlayer
        name = "midlayer." + name.removeprefix("layers.0.")
    name = name.removesuffix("_inv")  # fine-grained FP8's weight_scale_inv
    for kv in ("k", "v"):  # ModelOpt's k_proj.k_scale: the attention's k_scale
        name = name.replace(f".{kv}_proj.{kv}_scale", f".{kv}_scale")
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():
        stacked, proj = EXPERT_PROJ[parts[-2]]
        return ".".join([*parts[:-3], stacked]), (int(parts[-3]), proj)
    if len(parts) >= 2 and parts[-2] in STACKED:
        merged, part = STACKED[parts[-2]]
        return ".".join([*parts[:-2], merged, parts[-1]]), part
    return name, None


def _owner(model: nn.Module, name: str) -> nn.Module:
    """The module holding parameter `name` (the model itself for a top-level one)."""
    return model.get_submodule(name.rsplit(".", 1)[0] if "." in name else "")


def _full_shape(model: nn.Module, name: str, param: nn.Parameter, world: int,
                part: Part) -> tuple[int | None, tuple[int, ...]]:
    """The shard dim of a parameter and the shape its full checkpoint tensor must have."""
    owner = _owner(model, name)
    if part is not None:
        return 0, owner.part_shape(part, param)
    dim = getattr(owner, "shard_dim", None)
    if dim is None or (name.endswith(".bias") and dim == 1):
        return None, tuple(param.shape)
    shape = list(param.shape)
    shape[dim] = getattr(owner, "vocab", shape[dim] * world)
    return dim, tuple(shape)


def _expected(model: nn.Module, params: dict[str, nn.Parameter]) -> set[tuple[str, Part]]:
    out: set[tuple[str, Part]] = set()
    for name in params:
        owner = _owner(model, name)
        if hasattr(owner, "checkpoint_parts"):  # stacked experts: this rank's ones only
            out |= {(name, p) for p in owner.checkpoint_parts(name.rsplit(".", 1)[1])}
            continue
        sizes = getattr(owner, "local_sizes", None)
        out |= {(name, i) for i in range(len(sizes))} if sizes else {(name, None)}
    return out


@dataclass(frozen=True)
class _Slot:
    """Where a checkpoint tensor goes: a parameter (a part of it when merged), the dim this
    rank's shard is cut along, the full shape the tensor must have, whether it is FP8, and
    for a weight scale the full shape of the weight it scales."""

    name: str
    part: Part
    dim: int | None
    shape: tuple[int, ...]
    fp8: bool = False
    weight: tuple[int, ...] | None = None


def _slot(model: nn.Module, params: dict[str, nn.Parameter], world: int, ckpt_name: str,
          file: Path) -> _Slot | None:
    """None for a tensor this rank skips: rotary tables, a tied head, another EP rank's expert."""
    if ckpt_name.endswith(IGNORED_SUFFIXES):
        return None
    name, part = _target(ckpt_name)
    if name not in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            return None  # tied: the embedding already holds it
        raise CheckpointError(f"{file.name}: unexpected tensor {ckpt_name!r}")
    owner = _owner(model, name)
    if isinstance(part, tuple) and not owner.owns(part):
        return None
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight_scale":  # its rows split as W's; its columns (groups): see _copy_in
        weight = f"{name.rsplit('.', 1)[0]}.weight"
        dim, shape = _full_shape(model, weight, params[weight], world, part)
        return _Slot(name, part, 0 if dim == 0 else None,
                     stored_scale_shape(model.config.quant, shape), weight=shape)
    if leaf in QUANT_SCALARS:
        return _Slot(name, part, None, (1,))
    dim, shape = _full_shape(model, name, params[name], world, part)
    return _Slot(name, part, dim, shape, fp8=params[name].dtype == FP8)


# one float per tensor: a static input scale (its fused parts' largest), attention k/v scales
QUANT_SCALARS = ("input_scale", "k_scale", "v_scale")


def _check_shape(ckpt_name: str, file: Path, stored: StoredTensor, slot: _Slot) -> None:
    if stored.shape != slot.shape and not (stored.shape == () and slot.shape == (1,)):
        raise CheckpointError(f"{ckpt_name} in {file.name}: shape {stored.shape}, the config "
                              f"implies {slot.shape}")
    if (stored.dtype == "F8_E4M3") != slot.fp8:
        want = "F8_E4M3" if slot.fp8 else "not FP8: config.json quantizes no such layer"
        raise CheckpointError(f"{ckpt_name} in {file.name}: stored as {stored.dtype}; "
                              f"expected {want}")


def _check_complete(model: nn.Module, params: dict[str, nn.Parameter],
                    loaded: set[tuple[str, Part]], path: str) -> None:
    missing = sorted(_expected(model, params) - loaded, key=str)
    if missing:
        names = [_hf_name(n, p) for n, p in missing[:8]]
        raise CheckpointError(f"checkpoint {path!r} lacks tensors: {names}")


def load_weights(model: nn.Module, path: str, comm: Comm,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """`progress(tensors read, tensors in the checkpoint)` is called after each tensor."""
    params = dict(model.named_parameters())  # tied weights appear once
    loaded: set[tuple[str, Part]] = set()
    sources: dict[str, list[tuple[str, Path]]] = defaultdict(list)  # parameter -> its tensors
    headers = read_headers(path)  # a damaged file fails here, by name
    total, done = sum(len(h) for _, h in headers), 0
    for file, tensors in headers:
        with safe_open(str(file), framework="pt") as f:
            for ckpt_name, stored in tensors.items():
                done += 1
                if progress is not None:
                    progress(done, total)
                slot = _slot(model, params, comm.world_size, ckpt_name, file)
                if slot is None:
                    continue
                _check_shape(ckpt_name, file, stored, slot)
                _copy_in(model, params, slot, f.get_tensor(ckpt_name), comm)
                loaded.add((slot.name, slot.part))
                sources[slot.name].append((ckpt_name, file))
    _check_complete(model, params, loaded, path)
    _check_finite(params, sources)


def _copy_in(model: nn.Module, params: dict[str, nn.Parameter], slot: _Slot,
             full: torch.Tensor, comm: Comm) -> None:
    """This rank's slice of the full tensor `full` into the parameter (part) `slot` names."""
    param, leaf = params[slot.name], slot.name.rsplit(".", 1)[-1]
    owner = _owner(model, slot.name)
    if leaf == "input_scale":  # fused parts: the largest
        param.data.copy_(torch.maximum(param.data, full.float().reshape(1).to(param.device)))
        return
    if leaf in QUANT_SCALARS:
        param.data.copy_(full.reshape(1))
        return
    if slot.weight is not None:  # a weight scale, as rows [out, groups]
        full = scale_rows(full, model.config.quant, slot.weight)
        groups = param.shape[1]
        if isinstance(owner, RowParallelLinear) and full.shape[1] != groups:  # W's columns
            full = full.narrow(1, comm.rank * groups, groups)
    if slot.part is None:
        load_shard(param, full, slot.dim, comm)
    else:
        owner.load_part(param, full, slot.part)


def init_dummy_weights(model: nn.Module, comm: Comm,
                       progress: Callable[[int, int], None] | None = None) -> None:
    """Random weights in place of a checkpoint, to time a model's shapes with none on disk.
    Each full (unsharded) checkpoint tensor this rank needs is drawn on its parameter's device
    from a seed of its checkpoint name alone and sliced as a loaded one is, so every TP and
    EP layout holds the same model: normal(0, DUMMY_STD) matrices, ones for norm weights and
    zeros for biases, as HF initialises them. Rotary tables are buffers: left as built."""
    params = dict(model.named_parameters())
    expected = sorted(_expected(model, params), key=str)
    where = Path(model.config.path) / "config.json"  # names the model in an error
    loaded: set[tuple[str, Part]] = set()
    for done, (name, part) in enumerate(expected, 1):
        ckpt_name = _hf_name(name, part)
        slot = _slot(model, params, comm.world_size, ckpt_name, where)
        assert slot is not None, ckpt_name  # every expected tensor has a slot on this rank
        full = dummy_tensor(ckpt_name, slot.shape, params[slot.name])
        _copy_in(model, params, slot, full, comm)
        loaded.add((slot.name, slot.part))
        if progress is not None:
            progress(done, len(expected))
    _check_complete(model, params, loaded, model.config.path)
    _check_finite(params, {})


def dummy_tensor(ckpt_name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The full tensor `ckpt_name` of a dummy checkpoint, in `like`'s dtype on its device. An
    FP8 weight is drawn with unit spread and its scales are DUMMY_STD: the same spread."""
    if ckpt_name.endswith("weight_scale"):
        return torch.full(shape, DUMMY_STD, dtype=like.dtype, device=like.device)
    fp8 = like.dtype == FP8
    out = torch.empty(shape, dtype=torch.bfloat16 if fp8 else like.dtype, device=like.device)
    if ckpt_name.endswith("norm.weight"):
        return out.fill_(1.0)
    if not out.is_floating_point():  # an EAGLE-3 head's d2t: the identity map
        return out.zero_()
    if ckpt_name.endswith(".bias"):
        return out.zero_()
    gen = torch.Generator(device=like.device).manual_seed(crc32(ckpt_name.encode()))
    if fp8:
        return out.normal_(0.0, 1.0, generator=gen).to(FP8)
    return out.normal_(0.0, DUMMY_STD, generator=gen)


def _check_finite(params: dict[str, nn.Parameter],
                  sources: dict[str, list[tuple[str, Path]]]) -> None:
    """Refuse NaN or infinite weights, as loaded: after the cast to the model's dtype (a
    float32 value past float16's range is inf there). One reduction per parameter where it
    lives and one host sync for all; only on a failure are the checkpoint tensors of the
    failing parameters read again, to name the culprit."""
    names = [n for n, p in params.items() if p.numel()]
    flags = []
    for name in names:
        p = params[name]
        if p.dtype == FP8:  # e4m3fn has no inf; NaN is every exponent and mantissa bit set
            flags.append(((p.view(torch.uint8) & 0x7F) == 0x7F).any())
            continue
        lo, hi = torch.aminmax(p)  # NaN propagates to both
        flags.append(~(lo.isfinite() & hi.isfinite()))
    if not flags or not torch.stack(flags).any().item():
        return
    for name, bad in zip(names, torch.stack(flags).tolist()):
        if not bad:
            continue
        dtype = params[name].dtype
        for ckpt_name, file in sources.get(name, ()):
            with safe_open(str(file), framework="pt") as f:
                full = f.get_tensor(ckpt_name)
            stored, cast = (int((~t.float().isfinite()).sum()) for t in (full, full.to(dtype)))
            if stored:
                raise CheckpointError(f"{ckpt_name} in {file.name}: {stored} non-finite values")
            if cast:
                raise CheckpointError(f"{ckpt_name} in {file.name}: {cast} values out of the "
                                      f"range of {str(dtype).removeprefix('torch.')}")
        raise CheckpointError(f"{name}: non-finite values after loading")


def _hf_name(name: str, part: Part) -> str:
    """A parameter (and part) under the checkpoint name HF gives it, for error messages."""
    if isinstance(part, tuple):
        prefix, leaf = name.rsplit(".", 1)
        proj = {v: k for k, v in EXPERT_PROJ.items() if k.endswith("_proj")}[leaf, part[1]]
        return f"{prefix}.{part[0]}.{proj}.weight"
    if part is None:
        return name
    unstack = {v: k for k, v in STACKED.items()}  # (merged, part) -> HF name
    merged = name.split(".")[-2]
    return name.replace(merged, unstack[merged, part])
