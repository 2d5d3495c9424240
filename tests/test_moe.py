"""MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers on tiny random
checkpoints: TP=1 logits and greedy tokens, both expert implementations, padding rows, layout
errors, and TP=2 / DP=2 x EP=2 / TP=2 + EP=2 over a real 2-process gloo group in which the
DP ranks run different batches of different lengths, each idle for one step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygraph.config import ConfigError, ModelConfig, check_ep
from raygraph.graph.inputs import batch_from, host_inputs
from raygraph.model.context import forward_context
from raygraph.model.loader import build_model
from raygraph.model.moe import MoeForCausalLM, experts_dense, experts_grouped
from raygraph.model.parallel import Comm
from raygraph.protocol import SeqChunk, StepPlan
from tests.conftest import assert_close_across_shapes, free_port, make_checkpoint
from tests.hf_ref import hf_greedy

CPU = torch.device("cpu")
BLOCK = 4
MAX_TOKENS = 4
ARCHS = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # 6 experts, top-3, a shared expert, layer 1 dense: every Qwen2-MoE rule is exercised
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # q/k norms with head_dim 32 != hidden / heads, renormalised top-2 of 4, layer 1 dense
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        random_norms=True)),
}
# two DP ranks' prompts: different counts and lengths
PROMPTS = ([[5, 9, 33, 100, 7], [17, 3, 250, 8, 64, 99, 12, 41, 77, 6, 15, 200, 31]],
           [[42, 7, 19]])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), arch, **kw)
            for name, (arch, kw) in ARCHS.items()}


def bind_cache(model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, tp: int) -> None:
    shape = (num_blocks + 1, BLOCK, cfg.num_kv_heads // tp, cfg.head_dim)
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(shape)
        layer.v_cache = torch.zeros(shape)


def run_step(model: torch.nn.Module, chunks: list[SeqChunk], comm_tokens: int) -> torch.Tensor:
    batch = batch_from(host_inputs(StepPlan(0, chunks), BLOCK), CPU)
    ctx = dataclasses.replace(batch.ctx, num_comm_tokens=comm_tokens)
    with torch.no_grad(), forward_context(ctx):
        return model(batch.input_ids, batch.positions)[batch.sample_idx]


def local_tokens(prompts: list[list[int]], start: int, step: int) -> int:
    """Tokens a DP rank runs at `step` when it prefills at `start`, then decodes (0: idle)."""
    if step == start:
        return sum(map(len, prompts))
    return len(prompts) if start < step < start + MAX_TOKENS else 0


def greedy(model: torch.nn.Module, cfg: ModelConfig, prompts: list[list[int]], start: int,
           comm_tokens: list[int], tp: int = 1) -> list[list[int]]:
    """Greedy decoding over the paged cache: prefill all prompts at step `start`, then one
    token per step. An idle step runs one dummy token that writes only a scratch block."""
    per_seq = -(-(max(map(len, prompts)) + MAX_TOKENS) // BLOCK)
    bind_cache(model, cfg, per_seq * len(prompts) + 1, tp)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    for step, c in enumerate(comm_tokens):
        if step == start:
            chunks = [SeqChunk(i, p, 0, tables[i], True) for i, p in enumerate(prompts)]
        elif local_tokens(prompts, start, step):
            chunks = [SeqChunk(i, [o[-1]], len(p) + len(o) - 1, tables[i], True)
                      for i, (p, o) in enumerate(zip(prompts, out, strict=True))]
        else:
            run_step(model, [SeqChunk(-1, [0], 0, [per_seq * len(prompts)], False)], c)
            continue
        logits = model.compute_logits(run_step(model, chunks, c))
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return out


def comm_schedule(starts: tuple[int, ...]) -> list[int]:
    """num_comm_tokens per step: the max over DP ranks (an idle rank's dummy step has one
    token), rounded up to a multiple of 8 so real ranks carry padding rows too."""
    def bucket(step: int) -> int:
        most = max(max(1, local_tokens(p, s, step)) for p, s in zip(PROMPTS, starts, strict=True))
        return -(-most // 8) * 8

    return [bucket(step) for step in range(max(starts) + MAX_TOKENS)]


def load(path: Path, comm: Comm | None = None, ep_comm: Comm | None = None):
    cfg = ModelConfig.from_pretrained(str(path))
    return cfg, build_model(cfg, comm or Comm(), torch.float32, CPU, ep_comm)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_logits_and_greedy_tokens_match_hf(ckpts: dict[str, Path], arch: str) -> None:
    import transformers

    cfg, model = load(ckpts[arch])
    assert isinstance(model, MoeForCausalLM)
    prompts = PROMPTS[0] + PROMPTS[1]
    bind_cache(model, cfg, 12, 1)
    chunks = [SeqChunk(i, p, 0, list(range(4 * i, 4 * i + 4)), False)
              for i, p in enumerate(prompts)]
    batch = batch_from(host_inputs(StepPlan(0, chunks), BLOCK), CPU)
    with torch.no_grad(), forward_context(batch.ctx):
        logits = model.compute_logits(model(batch.input_ids, batch.positions))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts[arch], dtype=torch.float32)
    with torch.no_grad():
        ref = torch.cat([hf.eval()(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert greedy(model, cfg, prompts, 0, [0] * MAX_TOKENS) == hf_greedy(
        ckpts[arch], prompts, MAX_TOKENS)


def test_expert_implementations_agree_with_a_per_token_reference() -> None:
    torch.manual_seed(0)
    n_tok, h, inter, n_local, k = 23, 16, 8, 3, 3
    x = torch.randn(n_tok, h)
    gate_up, down = torch.randn(n_local, 2 * inter, h), torch.randn(n_local, h, inter)
    local = torch.stack([torch.randperm(n_local + 2)[:k] for _ in range(n_tok)])
    local = local.clamp(max=n_local)  # ids >= n_local: other ranks' experts (the sentinel)
    scores = torch.rand(n_tok, k)
    ref = torch.zeros_like(x)
    for t in range(n_tok):
        for e, s in zip(local[t].tolist(), scores[t].tolist(), strict=True):
            if e < n_local:
                g, u = (gate_up[e] @ x[t]).chunk(2)
                ref[t] += s * (down[e] @ (torch.nn.functional.silu(g) * u))
    for impl in (experts_dense, experts_grouped):
        torch.testing.assert_close(impl(x, gate_up, down, local, scores), ref,
                                   atol=1e-4, rtol=1e-5, msg=impl.__name__)


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_rows_do_not_change_real_tokens(ckpts: dict[str, Path], arch: str) -> None:
    cfg, model = load(ckpts[arch], ep_comm=Comm())  # the EP path over a group of one
    bind_cache(model, cfg, 8, 1)
    chunks = [SeqChunk(i, p, 0, list(range(4 * i, 4 * i + 4)), True)
              for i, p in enumerate(PROMPTS[0])]
    t = sum(len(c.token_ids) for c in chunks)
    exact = run_step(model, chunks, t)
    for pad in (1, 13):
        # padding rows change the expert GEMMs' M (t vs t + pad rows), and with it their
        # reduction order on some CPUs: equal to the dtype's rounding noise, not bitwise.
        # Padding leaking into a real row, or the wrong rows coming back, is far above it.
        assert_close_across_shapes(run_step(model, chunks, t + pad), exact,
                                   msg=lambda m, pad=pad: f"pad={pad}: {m}")
    with pytest.raises(ValueError, match="num_comm_tokens"):
        run_step(model, chunks, t - 1)


def test_layout_errors(ckpts: dict[str, Path]) -> None:
    cfg = ModelConfig.from_pretrained(str(ckpts["qwen2_moe"]))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == (6, 3, (1,))
    assert cfg.attention_bias and not cfg.norm_topk_prob
    assert [cfg.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    check_ep(cfg, 3, tp=2)
    with pytest.raises(ConfigError, match="ep=4 must divide num_experts=6"):
        check_ep(cfg, 4)
    with pytest.raises(ConfigError, match="tp=5 must divide moe_intermediate_size"):
        check_ep(cfg, 1, tp=5)
    with pytest.raises(ConfigError, match="needs an MoE model"):
        check_ep(msgspec.structs.replace(cfg, num_experts=0), 2)


# --- two ranks over gloo -------------------------------------------------------------------

LAYOUTS = ("tp2", "dp2_ep2", "tp2_ep2")


def _rank_main(rank: int, port: int, ckpts: dict[str, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    world = Comm(dist.group.WORLD)
    results: dict[tuple[str, str], list[list[int]]] = {}
    try:
        for arch, path in ckpts.items():
            for layout in LAYOUTS:
                tp = world if layout.startswith("tp2") else Comm()
                ep = world if layout.endswith("ep2") else None
                cfg, model = load(path, tp, ep)
                if layout == "dp2_ep2":  # each DP rank its own batch; rank 1 starts late
                    starts = (0, 1)
                    results[arch, layout] = greedy(model, cfg, PROMPTS[rank], starts[rank],
                                                   comm_schedule(starts))
                else:  # TP peers share one batch (with EP: every token twice in the gather)
                    results[arch, layout] = greedy(model, cfg, PROMPTS[0] + PROMPTS[1], 0,
                                                   [24] * MAX_TOKENS, tp.world_size)
            results[arch, "idle_block"] = _idle_block_check(rank, path, world)
    finally:
        dist.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


def _idle_block_check(rank: int, path: Path, world: Comm) -> list[list[int]]:
    """One MoE block under EP with T = 0 on rank 1 (C = 8): rank 0's output equals the
    unsharded block's, rank 1 gets zero rows back. [[1]] when that holds."""
    _, ref = load(path)
    _, ep_model = load(path, ep_comm=world)
    block, ref_block = ep_model.model.layers[0].mlp, ref.model.layers[0].mlp
    torch.manual_seed(1)
    x = torch.randn(5, block.gate.weight.shape[1])[: 5 if rank == 0 else 0]
    md = batch_from(host_inputs(StepPlan(0, [SeqChunk(0, [1], 0, [0], True)]), BLOCK), CPU)
    with torch.no_grad(), forward_context(dataclasses.replace(md.ctx, num_comm_tokens=8)):
        y = block(x)
        ok = torch.allclose(y, ref_block(x), atol=1e-6) if rank == 0 else y.shape[0] == 0
    return [[int(ok)]]


def test_two_ranks_tp2_dp2_ep2_and_tp2_ep2_match_hf(ckpts: dict[str, Path],
                                                     tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(free_port(), ckpts, tmp_path), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for arch, path in ckpts.items():
        want = [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
        for rank in range(2):
            assert got[rank][arch, "dp2_ep2"] == want[rank], (arch, rank)
            for layout in ("tp2", "tp2_ep2"):
                assert got[rank][arch, layout] == want[0] + want[1], (arch, layout, rank)
            assert got[rank][arch, "idle_block"] == [[1]], (arch, rank)
