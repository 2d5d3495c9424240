"""GPU: the 1B-class Llama-3-style (llama3 rope, 128k vocabulary, tied embeddings) and
Qwen3-style (q/k norms, head size 128, 152k vocabulary) checkpoints of bench/checkpoints.py
through full graphs give the greedy tokens of eager mode (float32: at these widths bf16
rounding alone can flip an argmax between two GEMM shapes)."""

from __future__ import annotations

import random

import pytest

from bench.checkpoints import make_random_checkpoint
from tests.gpu.test_graphs_gpu import greedy_graph_and_eager

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["llama3-1b", "qwen3-1b"])
def test_preset_greedy_tokens_full_graphs_equal_eager(preset, tmp_path_factory):
    ckpt = make_random_checkpoint(tmp_path_factory.mktemp(preset), preset)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(1, 150))]
               for _ in range(12)]
    graph, eager = greedy_graph_and_eager(ckpt, prompts, 16, "full")
    assert graph == eager
