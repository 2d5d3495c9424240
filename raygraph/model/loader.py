"""HF checkpoint loading: config.json + *.safetensors (single file or sharded index),
each rank reading only its own slice of every tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from raygraph.config import ModelConfig, check_ep
from raygraph.model.llama import LlamaForCausalLM
from raygraph.model.moe import MoeForCausalLM
from raygraph.model.parallel import Comm, load_shard

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, with the tensor named."""


def checkpoint_files(path: str) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint files listed in the index are missing: {missing}")
    return files


def build_model(
    cfg: ModelConfig, comm: Comm, dtype: torch.dtype, device: torch.device,
    ep_comm: Comm | None = None, progress: Callable[[int, int], None] | None = None,
) -> nn.Module:
    """Construct the model on `device` and load this rank's shard of the checkpoint.

    `comm` is the TP group (attention, dense MLPs, shared experts; experts too without EP);
    `ep_comm`, for MoE models, the expert-parallel group that owns the experts between it.
    """
    check_ep(cfg, ep_comm.world_size if ep_comm else 1, comm.world_size)
    with torch.device(device):
        if cfg.num_experts:
            model: nn.Module = MoeForCausalLM(cfg, comm, ep_comm)
        else:
            model = LlamaForCausalLM(cfg, comm)
    model.to(dtype=dtype)
    for module in model.modules():  # rotary tables stay fp32
        if hasattr(module, "cos"):
            module.float()
    load_weights(model, cfg.path, comm, progress)
    return model.eval()


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
    parts = name.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():
        stacked, proj = EXPERT_PROJ[parts[-2]]
        return ".".join([*parts[:-3], stacked]), (int(parts[-3]), proj)
    if len(parts) >= 2 and parts[-2] in STACKED:
        merged, part = STACKED[parts[-2]]
        return ".".join([*parts[:-2], merged, parts[-1]]), part
    return name, None


def _full_shape(model: nn.Module, name: str, param: nn.Parameter, world: int,
                part: Part) -> tuple[int | None, tuple[int, ...]]:
    """The shard dim of a parameter and the shape its full checkpoint tensor must have."""
    owner = model.get_submodule(name.rsplit(".", 1)[0])
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
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if hasattr(owner, "checkpoint_parts"):  # stacked experts: this rank's ones only
            out |= {(name, p) for p in owner.checkpoint_parts(name.rsplit(".", 1)[1])}
            continue
        sizes = getattr(owner, "local_sizes", None)
        out |= {(name, i) for i in range(len(sizes))} if sizes else {(name, None)}
    return out


def load_weights(model: nn.Module, path: str, comm: Comm,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """`progress(tensors read, tensors in the checkpoint)` is called after each tensor."""
    params = dict(model.named_parameters())  # tied weights appear once
    loaded: set[tuple[str, Part]] = set()
    files = checkpoint_files(path)
    names: list[list[str]] = []
    for file in files:  # headers only: the total for progress
        with safe_open(str(file), framework="pt") as f:
            names.append(list(f.keys()))
    total, done = sum(len(n) for n in names), 0
    for file, keys in zip(files, names):
        with safe_open(str(file), framework="pt") as f:
            for ckpt_name in keys:
                done += 1
                if progress is not None:
                    progress(done, total)
                if ckpt_name.endswith(IGNORED_SUFFIXES):
                    continue
                name, part = _target(ckpt_name)
                if name not in params:
                    if name == "lm_head.weight" and model.config.tie_word_embeddings:
                        continue  # tied: the embedding already holds it
                    raise CheckpointError(f"{file.name}: unexpected tensor {ckpt_name!r}")
                owner = model.get_submodule(name.rsplit(".", 1)[0])
                if isinstance(part, tuple) and not owner.owns(part):
                    continue  # another EP rank's expert: not even read
                full = f.get_tensor(ckpt_name)
                dim, expect = _full_shape(model, name, params[name], comm.world_size, part)
                if tuple(full.shape) != expect:
                    raise CheckpointError(
                        f"{file.name}: tensor {ckpt_name!r} has shape {tuple(full.shape)}, "
                        f"the config implies {expect}"
                    )
                if part is None:
                    load_shard(params[name], full, dim, comm)
                else:
                    owner.load_part(params[name], full, part)
                loaded.add((name, part))
    missing = sorted(_expected(model, params) - loaded, key=str)
    if missing:
        names = [_hf_name(n, p) for n, p in missing[:8]]
        raise CheckpointError(f"checkpoint {path!r} lacks tensors: {names}")


def _hf_name(name: str, part: Part) -> str:
    """A parameter (and part) under the checkpoint name HF gives it, for error messages."""
    prefix, leaf = name.rsplit(".", 1)
    if isinstance(part, tuple):
        proj = {v: k for k, v in EXPERT_PROJ.items() if k.endswith("_proj")}[leaf, part[1]]
        return f"{prefix}.{part[0]}.{proj}.weight"
    if part is None:
        return name
    unstack = {v: k for k, v in STACKED.items()}  # (merged, part) -> HF name
    merged = name.split(".")[-2]
    return name.replace(merged, unstack[merged, part])
