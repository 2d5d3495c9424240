"""Tensor-parallel layers and the one communication layer every collective goes through."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raygraph.model import ops
from raygraph.model.lora_ops import LoRAWeights, lora_linear
from raygraph.model.quant import Fp8Layout, Fp8Weight, fp8_weight
from raygraph.protocol import Collective


class Comm:
    """A process group handle. World size 1 makes every collective a no-op.

    Every collective goes through here, so a capture can record the ordered list of what
    it issued (`recording`): ranks whose lists differ would deadlock or corrupt at replay.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.trace: list[Collective] | None = None  # set by recording()

    def _note(self, op: str, x: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append(Collective(op, str(x.dtype).removeprefix("torch."), x.numel(),
                                         self.world_size))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            self._note("all_reduce", x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        self._note("all_gather", x)
        # gloo and NCCL both take the output as the inputs stacked along dim 0
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        if dim % x.dim() == 0:
            return out
        return torch.cat(out.chunk(self.world_size, dim=0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, then rank r keeps rows [r*n, (r+1)*n) of dim 0 (n = rows / world)."""
        if self.world_size == 1:
            return x
        self._note("reduce_scatter", x)
        if x.device.type == "cpu":  # gloo has no reduce_scatter_tensor
            dist.all_reduce(x, group=self.group)
            return x.chunk(self.world_size, dim=0)[self.rank].clone()
        out = torch.empty((x.shape[0] // self.world_size, *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out


@contextmanager
def recording(comms: list[Comm]) -> Iterator[list[Collective]]:
    """Record every collective issued through `comms`, in issue order, into one list."""
    trace: list[Collective] = []
    for c in comms:
        if c.trace is not None:
            raise RuntimeError("collectives are already being recorded; nesting is a bug")
        c.trace = trace
    try:
        yield trace
    finally:
        for c in comms:
            c.trace = None


def comms_of(model: nn.Module) -> list[Comm]:
    """The distinct Comm objects a model's layers hold (TP group, EP group, ...)."""
    seen: dict[int, Comm] = {}
    for m in model.modules():
        c = getattr(m, "comm", None)
        if isinstance(c, Comm):
            seen.setdefault(id(c), c)
    return list(seen.values())


def _divide(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"{what}={n} is not divisible by the TP size {world}")
    return n // world


class LoRARows(nn.Module):
    """A linear layer whose weight may carry rows after W's (append_rows): a LoRA model
    keeps every adapter slot's A there, so a decode GEMM also computes every slot's shrink
    (model/lora_ops.py: lora_linear)."""

    def __init__(self, out_local: int) -> None:
        super().__init__()
        self.out_local = out_local  # W's rows on this rank
        self.lora: LoRAWeights | None = None  # the adapter slots (raygraph/lora)
        self.fp8: Fp8Layout | None = None  # set when W is held in FP8 (model/quant.py)

    @property
    def base_weight(self) -> torch.Tensor | Fp8Weight:
        """W, without the adapter rows after it (FP8 layers have none)."""
        if self.fp8 is not None:
            return fp8_weight(self)
        return self.weight[: self.out_local]

    @property
    def gemm_weight(self) -> torch.Tensor | Fp8Weight:
        """What the layer's GEMM multiplies by: W and any adapter rows after it."""
        return self.weight if self.fp8 is None else fp8_weight(self)

    def append_rows(self, rows: int) -> None:
        """`rows` more rows (zeros) after W's, in one new weight."""
        w = self.weight.data
        ext = torch.zeros(w.shape[0] + rows, w.shape[1], dtype=w.dtype, device=w.device)
        ext[: w.shape[0]].copy_(w)
        self.weight = nn.Parameter(ext, requires_grad=False)


class ColumnParallelLinear(LoRARows):
    """y = x W^T with W split by output rows; each rank returns its slice of y."""

    def __init__(self, in_f: int, out_f: int, comm: Comm, bias: bool = False) -> None:
        local = _divide(out_f, comm.world_size, "output features")
        super().__init__(local)  # adapters: B split as W, A whole
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(local, in_f), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(local), requires_grad=False) if bias else None
        self.shard_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_linear(x, self.gemm_weight, self.bias, self.lora)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections as one GEMM (q|k|v, gate|up). Each part is split
    over the ranks on its own; a rank's slices are stacked in part order.

    `shards[i]` splits part i into fewer slices than ranks, each held by world / shards[i]
    ranks in a row: K and V when TP exceeds the KV heads (each rank keeps the KV head its
    query heads read)."""

    def __init__(self, in_f: int, out_sizes: list[int], comm: Comm, bias: bool = False,
                 shards: list[int] | None = None) -> None:
        world = comm.world_size
        self.shards = shards or [world] * len(out_sizes)
        if any(world % s for s in self.shards):
            raise ValueError(f"shard counts {self.shards} must divide the TP size {world}")
        local = [_divide(o, s, "output features") for o, s in zip(out_sizes, self.shards)]
        super().__init__(in_f, sum(local) * world, comm, bias)
        self.local_sizes = local

    def part_shape(self, part: int, param: nn.Parameter) -> tuple[int, ...]:
        """The full checkpoint shape of one part."""
        return (self.local_sizes[part] * self.shards[part], *param.shape[1:])

    def load_part(self, param: nn.Parameter, full: torch.Tensor, part: int) -> None:
        size = self.local_sizes[part]
        start = sum(self.local_sizes[:part])
        shard = self.comm.rank * self.shards[part] // self.comm.world_size
        param.data[start : start + size].copy_(full.narrow(0, shard * size, size))


class RowParallelLinear(LoRARows):
    """y = x W^T with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_f: int, out_f: int, comm: Comm) -> None:
        super().__init__(out_f)  # adapters: A split as W, B replicated
        self.comm = comm
        local = _divide(in_f, comm.world_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_f, local), requires_grad=False)
        self.shard_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each rank's delta is partial (A split on the input), like its GEMM: one all-reduce.
        # With adapter rows y is a view of a wider GEMM output: made contiguous (a copy of
        # [T, out]) for the all-reduce and the ops after
        return self.comm.all_reduce(
            lora_linear(x, self.gemm_weight, None, self.lora).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Rows split over ranks (vocab padded to a multiple of the TP size)."""

    def __init__(self, vocab: int, dim: int, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.vocab = vocab
        self.per_rank = -(-vocab // comm.world_size)
        self.start = comm.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim), requires_grad=False)
        self.shard_dim = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.comm.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The vocab-parallel output projection; logits are all-gathered to every rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.weight)
        return self.comm.all_gather(logits, dim=-1)[..., : self.vocab]


def load_shard(param: nn.Parameter, full: torch.Tensor, shard_dim: int | None, comm: Comm) -> None:
    """Copy this rank's slice of a full checkpoint tensor into `param` (zero-padded at the end)."""
    if shard_dim is None:
        local = full
    else:
        size = param.shape[shard_dim]
        start = comm.rank * size
        local = full.narrow(shard_dim, start, max(0, min(size, full.shape[shard_dim] - start)))
    if local.shape == param.shape:
        param.data.copy_(local)
        return
    param.data.zero_()
    param.data[tuple(slice(0, s) for s in local.shape)].copy_(local)
