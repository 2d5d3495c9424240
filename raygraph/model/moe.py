"""Sparse MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) with tensor- or expert-parallel experts.

Tensor parallel (no EP group): every rank holds every expert with its intermediate dim split
over the TP group; the partial outputs are all-reduced, like the dense MLP.

Expert parallel: each rank of the EP group owns num_experts / ep whole experts. Every rank
pads its T tokens to the step's `num_comm_tokens` C (the same on every EP rank), all-gathers
[ep * C, H], runs its own experts on every gathered token, and reduce-scatters: rank r gets
back rows [r * C, (r + 1) * C), each token's weighted sum over its top-k experts, wherever
they live. Each expert lives on exactly one rank, so duplicated tokens (TP peers inside a DP
group) still come out exact. Shapes depend only on (T, C): the forward is capturable, and an
idle rank (T = 0) still joins both collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raygraph.config import ModelConfig
from raygraph.model import ops
from raygraph.model.context import get_forward_context
from raygraph.model.llama import MLP, LlamaForCausalLM
from raygraph.model.parallel import Comm

# (expert, projection): projection 0/1 = gate/up rows of gate_up_proj, 0 = down_proj
ExpertPart = tuple[int, int]


class TopKRouter(nn.Module):
    """Softmax over all experts in fp32, keep the top k, optionally renormalise them."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k] int64, routing weights [N, k] fp32)."""
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        scores, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return ids, scores


class Experts(nn.Module):
    """This rank's experts as stacked SwiGLU weights, in HF's fused layout:
    gate_up_proj [E_local, 2 * I_local, H] (gate rows, then up rows), down_proj
    [E_local, H, I_local]. Returns this rank's partial sum; the caller combines ranks."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: Comm,
                 ep: Comm | None) -> None:
        super().__init__()
        ep_size, ep_rank = (ep.world_size, ep.rank) if ep is not None else (1, 0)
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep_size}")
        self.tp = tp if ep is None else Comm()  # EP experts are whole: no TP split
        if inter % self.tp.world_size:
            raise ValueError(f"moe intermediate size {inter} is not divisible by the TP size "
                             f"{self.tp.world_size}")
        self.num_local = num_experts // ep_size
        self.first = ep_rank * self.num_local  # global id of local expert 0
        self.inter_local = inter // self.tp.world_size
        n, i = self.num_local, self.inter_local
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n, hidden, i), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # x: [N, H]; ids, scores: [N, k]. Other ranks' experts map to the sentinel num_local.
        local = ids - self.first
        local = local.masked_fill((local < 0) | (local >= self.num_local), self.num_local)
        impl = experts_grouped if x.device.type == "cpu" else experts_dense
        return impl(x, self.gate_up_proj, self.down_proj, local, scores)

    # --- checkpoint loading (HF stores one tensor per expert and projection) ---

    def checkpoint_parts(self, param: str) -> list[ExpertPart]:
        projs = (0, 1) if param == "gate_up_proj" else (0,)
        return [(e, j) for e in range(self.first, self.first + self.num_local) for j in projs]

    def owns(self, part: ExpertPart) -> bool:
        return self.first <= part[0] < self.first + self.num_local

    def part_shape(self, part: ExpertPart, param: nn.Parameter) -> tuple[int, ...]:
        """The checkpoint shape of one expert's projection."""
        i, h = self.inter_local * self.tp.world_size, self.down_proj.shape[1]
        return (i, h) if param is self.gate_up_proj else (h, i)

    def load_part(self, param: nn.Parameter, full: torch.Tensor, part: ExpertPart) -> None:
        e, j = part[0] - self.first, part[1]
        i, start = self.inter_local, self.tp.rank * self.inter_local
        if param is self.gate_up_proj:
            param.data[e, j * i : (j + 1) * i].copy_(full.narrow(0, start, i))
        else:
            param.data[e].copy_(full.narrow(1, start, i))


def experts_dense(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  local: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Every local expert on every token, weighted by its (mostly zero) routing weight.

    E_local / k times the FLOPs of routed compute, but plain GEMMs on any device and dtype,
    capturable, and the sum runs in expert order from zero as HF's does (bitwise in fp32).
    """
    n = gate_up.shape[0]
    route = scores.new_zeros(x.shape[0], n + 1).scatter_add_(1, local, scores)  # [N, E_local+1]
    out = torch.zeros_like(x)
    for e in range(n):
        y = F.linear(ops.silu_and_mul(F.linear(x, gate_up[e])), down[e])
        out += (y * route[:, e, None]).to(x.dtype)
    return out


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    local: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Routed compute only: sort the N * k (token, expert) pairs by local expert (other ranks'
    experts last), one grouped GEMM per projection with device-side group ends, mask the
    foreign pairs, sum each token's k rows. Static shapes, no host sync in the sort itself.

    NOTE: torch._grouped_mm reads the group ends on the host except on its bf16 sm90+ CUDA
    path, so on GPUs this is capturable only there.
    """
    n_tok, k = local.shape
    n = gate_up.shape[0]
    keys = local.flatten()
    order = keys.argsort(stable=True)
    sorted_keys = keys[order]
    ends = torch.searchsorted(sorted_keys, torch.arange(n, device=x.device), right=True)
    ends = ends.to(torch.int32)
    h = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(ops.silu_and_mul(h), down.transpose(1, 2), offs=ends)
    # rows past the last group are never written: select, do not multiply
    mine = (sorted_keys < n).unsqueeze(1)
    y = torch.where(mine, y * scores.flatten()[order].unsqueeze(1), 0).to(x.dtype)
    pairs = torch.empty_like(y).index_copy_(0, order, y)  # back to [token, slot] order
    return pairs.view(n_tok, k, -1).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert), named as HF names them."""

    def __init__(self, cfg: ModelConfig, comm: Comm, ep_comm: Comm | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.gate = TopKRouter(h, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, comm, ep_comm)
        # the group whose partial outputs sum to the block's output (recorded at capture)
        self.comm = ep_comm if ep_comm is not None else comm
        self.expert_parallel = ep_comm is not None
        # Qwen2/3-MoE weigh expert outputs in the model dtype, Mixtral in fp32 (as HF does)
        self.scores_in_model_dtype = cfg.family in ("qwen2_moe", "qwen3_moe")
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, comm, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        if self.expert_parallel:
            y = self._dispatch_combine(x)
        else:
            y = self.comm.all_reduce(self._local_experts(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

    def _local_experts(self, x: torch.Tensor) -> torch.Tensor:
        ids, scores = self.gate(x)
        if self.scores_in_model_dtype:
            scores = scores.to(x.dtype)
        return self.experts(x, ids, scores)

    def _dispatch_combine(self, x: torch.Tensor) -> torch.Tensor:
        t, c = x.shape[0], get_forward_context().num_comm_tokens
        if c < max(t, 1):
            raise ValueError(
                f"expert parallelism needs ForwardContext.num_comm_tokens >= the {t} local "
                f"tokens (and >= 1), got {c}: set it to the bucketed max over the DP group")
        padded = F.pad(x, (0, 0, 0, c - t))  # [C, H]; padding rows are zeros
        gathered = self.comm.all_gather(padded, dim=0)  # [ep * C, H]
        return self.comm.reduce_scatter(self._local_experts(gathered))[:t]


class MoeForCausalLM(LlamaForCausalLM):
    """Llama-style attention, norms and embeddings; sparse layers use SparseMoeBlock. One
    class serves Mixtral, Qwen2-MoE and Qwen3-MoE: the config says which parts a layer has."""

    def __init__(self, cfg: ModelConfig, comm: Comm, ep_comm: Comm | None = None) -> None:
        def make_mlp(layer: int) -> nn.Module:
            if cfg.is_sparse_layer(layer):
                return SparseMoeBlock(cfg, comm, ep_comm)
            return MLP(cfg, comm)

        super().__init__(cfg, comm, make_mlp)


MixtralForCausalLM = MoeForCausalLM
Qwen2MoeForCausalLM = MoeForCausalLM
Qwen3MoeForCausalLM = MoeForCausalLM
