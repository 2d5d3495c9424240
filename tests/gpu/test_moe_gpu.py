"""GPU: both expert implementations and a whole MoE block (EP path, padded to C rows) replay
from a CUDA graph exactly as they run eagerly. The grouped case says whether
torch._grouped_mm (bf16, device-side group ends) is capturable on this GPU and torch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raygraph.config import ModelConfig
from raygraph.graph.inputs import batch_from, host_inputs
from raygraph.model.context import forward_context
from raygraph.model.loader import build_model
from raygraph.model.moe import experts_dense, experts_grouped
from raygraph.model.parallel import Comm
from raygraph.protocol import SeqChunk, StepPlan
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.gpu


def graph_of(fn, *args: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm up on a side stream, capture `fn(*args)`, return (graph, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


@pytest.mark.parametrize("impl", [experts_dense, experts_grouped], ids=lambda f: f.__name__)
def test_experts_replay_equals_eager(impl) -> None:
    torch.manual_seed(0)
    n, h, inter, n_local, k = 64, 256, 512, 4, 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    gate_up = torch.randn(n_local, 2 * inter, h, device=dev, dtype=dt) * 0.05
    down = torch.randn(n_local, h, inter, device=dev, dtype=dt) * 0.05
    x = torch.randn(n, h, device=dev, dtype=dt)
    local = torch.randint(0, n_local + 1, (n, k), device=dev)  # n_local: another rank's
    scores = torch.rand(n, k, device=dev)
    graph, out = graph_of(impl, x, gate_up, down, local, scores)
    for trial in range(3):  # new routing and tokens each replay, same buffers
        x.copy_(torch.randn_like(x))
        local.copy_(torch.randint(0, n_local + 1, (n, k), device=dev))
        graph.replay()
        assert torch.equal(out, impl(x, gate_up, down, local, scores)), trial


def test_moe_block_ep_path_replay_equals_eager(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "Qwen2MoeForCausalLM", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=96)
    cfg = ModelConfig.from_pretrained(str(path))
    model = build_model(cfg, Comm(), torch.bfloat16, torch.device("cuda"), ep_comm=Comm())
    block = model.model.layers[0].mlp
    x = torch.randn(5, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    batch = batch_from(host_inputs(StepPlan(0, [SeqChunk(0, [1], 0, [0], True)]), 16),
                       torch.device("cuda"))
    with torch.no_grad(), forward_context(dataclasses.replace(batch.ctx, num_comm_tokens=8)):
        graph, out = graph_of(block, x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, block(x))
