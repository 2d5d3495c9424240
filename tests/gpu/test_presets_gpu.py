"""GPU: the 1B-class Llama-3-style (llama3 rope, 128k vocabulary, tied embeddings) and
Qwen3-style (q/k norms, head size 128, 152k vocabulary) checkpoints of bench/checkpoints.py
through full graphs give the greedy tokens of eager mode (float32: at these widths bf16
rounding alone can flip an argmax between two GEMM shapes)."""

from __future__ import annotations

import random

import pytest

from bench.checkpoints import make_random_checkpoint
from raygraph.cluster.engine import EngineCore, local_dispatch, run_to_completion
from raygraph.cluster.scheduler import Scheduler, Sequence
from raygraph.memory.pool import PagePool
from raygraph.protocol import SamplingParams
from tests.gpu.test_graphs_gpu import worker

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["llama3-1b", "qwen3-1b"])
def test_preset_greedy_tokens_full_graphs_equal_eager(preset, tmp_path_factory):
    ckpt = make_random_checkpoint(tmp_path_factory.mktemp(preset), preset)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(1, 150))]
               for _ in range(12)]
    outs = []
    for mode in ("graph", "eager"):
        w = worker(ckpt, mode, "float32", "full")
        sched = Scheduler(PagePool(256, 16), 32, 128, 512)
        seqs = [Sequence(i, p, SamplingParams(max_tokens=16, ignore_eos=True))
                for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        run_to_completion(EngineCore([sched], None, ep=False), local_dispatch(w))
        outs.append([s.output_token_ids for s in seqs])
        w.shutdown()
    assert outs[0] == outs[1]
