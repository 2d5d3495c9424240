"""Mistral's sliding window as transformers applies it (each query sees its last
`sliding_window` keys): greedy tokens equal HF through the served loop's logic, in graph mode
(eager backend) and eager, with prompts several windows and chunks long; configs whose windows
differ per layer are refused by name."""

from __future__ import annotations

import json

import pytest

from raygraph.config import (
    CacheConfig,
    ConfigError,
    GraphConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.engine.sequence import Sequence
from raygraph.protocol import SamplingParams
from tests.conftest import loaded_worker, make_checkpoint, serve_in_process
from tests.hf_ref import hf_greedy

WINDOW = 8
PROMPTS = [[5, 9, 11] * 12, [7], [30 + i for i in range(23)]]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mistral"), "MistralForCausalLM",
                           sliding_window=WINDOW)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_greedy_tokens_equal_hf(mistral, mode):
    cfg = ServeConfig(model=str(mistral), device="cpu",
                      cache=CacheConfig(block_size=4, num_blocks=96),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                max_model_len=128),
                      graph=GraphConfig(mode=mode))
    w = loaded_worker(cfg, 96, capture=True)
    assert w.model_cfg.sliding_window == WINDOW
    seqs = serve_in_process(cfg, w, [Sequence(i, p, SamplingParams(max_tokens=12,
                                                                   ignore_eos=True))
                                     for i, p in enumerate(PROMPTS)], 96)
    assert [s.output_token_ids for s in seqs] == hf_greedy(mistral, PROMPTS, 12)


def test_the_window_changes_the_tokens(mistral, tmp_path):
    """The check above can fail: without the window, HF itself gives other tokens."""
    full = tmp_path / "full"
    full.mkdir()
    for f in mistral.iterdir():
        (full / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(str(full)).sliding_window == 0
    assert hf_greedy(full, PROMPTS, 12) != hf_greedy(mistral, PROMPTS, 12)


@pytest.mark.parametrize("arch,fields,match", [
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8},
     "use_sliding_window"),
    ("MistralForCausalLM", {"layer_types": ["sliding_attention", "full_attention"]},
     "layer_types"),
])
def test_windows_per_layer_are_refused(tmp_path, arch, fields, match):
    path = make_checkpoint(tmp_path / "m", arch)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_pretrained(str(path))
