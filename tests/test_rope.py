"""RoPE variants as transformers computes them: the frequencies match its own functions, and
checkpoints saved with each variant serve greedy tokens identical to HF."""

from __future__ import annotations

import pytest
import torch

from raygraph.config import (
    CacheConfig,
    ConfigError,
    GraphConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.engine.sequence import Sequence
from raygraph.model.rope import rope_frequencies
from raygraph.protocol import SamplingParams
from tests.conftest import loaded_worker, make_checkpoint, serve_in_process
from tests.hf_ref import hf_greedy

VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    params = {**VARIANTS[request.param], "rope_theta": 500000.0}
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), "LlamaForCausalLM",
                           rope_parameters=params)
    return request.param, path


def test_frequencies_equal_transformers(checkpoint):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind, path = checkpoint
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    ours = ModelConfig.from_pretrained(str(path))
    assert ours.rope_scaling["rope_type"] == kind
    inv, scale = rope_frequencies(ours)
    if kind == "dynamic":  # within max_position_embeddings transformers uses the default
        want, want_scale = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, None, seq_len=None)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, None)
    torch.testing.assert_close(inv, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


# 1 to 150 tokens in 16-token chunks: positions past original_max_position_embeddings
PROMPTS = [[5, 9, 11] * 12, [7], [30 + i for i in range(20)],
           [(7 * i) % 250 + 3 for i in range(150)]]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_greedy_tokens_equal_hf(checkpoint, mode):
    _, path = checkpoint
    cfg = ServeConfig(model=str(path), device="cpu",
                      cache=CacheConfig(block_size=4, num_blocks=128),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                      graph=GraphConfig(mode=mode))
    w = loaded_worker(cfg, 128, capture=mode == "graph")
    seqs = serve_in_process(cfg, w, [Sequence(i, p, SamplingParams(max_tokens=12,
                                                                   ignore_eos=True))
                                     for i, p in enumerate(PROMPTS)], 128)
    assert [s.output_token_ids for s in seqs] == hf_greedy(path, PROMPTS, 12)


# the tables are the same on every rank: one scaled variant splits heads as any other
@pytest.mark.parametrize("kind", ["llama3", pytest.param("yarn", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_hf_tp2(ray_session, tmp_path, kind):
    """The scaled variants over two gloo ranks through the coordinator (heads split)."""
    from tests.test_generate_hf import serve

    path = make_checkpoint(tmp_path / kind, "LlamaForCausalLM",
                           rope_parameters={**VARIANTS[kind], "rope_theta": 500000.0})
    coord = serve(ray_session, path, 2)
    try:
        results = ray_session.get(coord.generate.remote(
            PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True)))
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)
    assert [r.token_ids for r in results] == hf_greedy(path, PROMPTS, 12)


def test_unknown_rope_type_is_refused_by_name(tmp_path):
    path = make_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    cfg = (path / "config.json").read_text().replace('"rope_type": "default"',
                                                     '"rope_type": "longrope"')
    (path / "config.json").write_text(cfg)
    with pytest.raises(ConfigError, match="rope type 'longrope'.*not supported"):
        ModelConfig.from_pretrained(str(path))
