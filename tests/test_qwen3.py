"""Qwen3 dense and Qwen3-MoE served end to end (coordinator, Ray workers, chunked prefill)
give HF's greedy tokens, and config.json fields whose math raygraph does not compute are
refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from raygraph.config import (
    CacheConfig,
    ConfigError,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.protocol import SamplingParams
from tests.conftest import make_checkpoint, start_coordinators, stop_coordinators
from tests.hf_ref import hf_greedy

MAX_TOKENS = 8
# head_dim 32 while hidden / heads = 16: q_norm, k_norm and o_proj see the explicit size
QWEN3 = dict(head_dim=32, tie_word_embeddings=True)
QWEN3_MOE = dict(head_dim=32, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
GRAPH = GraphConfig(decode_sizes=[1, 2, 4, 8], prefill_sizes=[8, 16, 32])
# (tp, dp, ep, graph mode) per family: TP=1 in graph and eager mode, TP=2, and for the
# MoE expert parallelism over two DP groups
LAYOUTS = {
    "qwen3": [(1, 1, 1, "graph"), (1, 1, 1, "eager"), (2, 1, 1, "graph")],
    "qwen3_moe": [(1, 1, 1, "graph"), (2, 1, 1, "eager"), (1, 2, 2, "graph")],
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "qwen3": make_checkpoint(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM",
                                 random_norms=True, **QWEN3),
        "qwen3_moe": make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"),
                                     "Qwen3MoeForCausalLM", random_norms=True, **QWEN3_MOE),
    }


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    # 1 to 150 tokens: the long ones span several 32-token chunks
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 4, 17, 40, 150)]


def config(model: Path, name: str, tp: int, dp: int, ep: int, mode: str) -> ServeConfig:
    return ServeConfig(
        model=str(model), device="cpu", parallel=ParallelConfig(tp=tp, dp=dp, ep=ep),
        graph=GraphConfig(mode=mode, decode_sizes=GRAPH.decode_sizes,
                          prefill_sizes=GRAPH.prefill_sizes),
        cache=CacheConfig(block_size=4, num_blocks=160),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        coordinator_name=f"{name}-{tp}{dp}{ep}-{mode}", step_timeout_s=60,
    )


def side_by_side(layouts: list[tuple], slots: int = 4) -> list[list[tuple]]:
    """`layouts` in order, in groups of at most `slots` workers: a group's coordinators run
    at once (the session's Ray has 6 CPU slots, one may be held by a shared coordinator)."""
    groups: list[list[tuple]] = [[]]
    for layout in layouts:
        if groups[-1] and sum(tp * dp for tp, dp, _, _ in groups[-1] + [layout]) > slots:
            groups.append([])
        groups[-1].append(layout)
    return groups


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_greedy_tokens_equal_hf(ray_session, ckpts: dict[str, Path], family: str) -> None:
    ps = prompts()
    want = hf_greedy(ckpts[family], ps, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for group in side_by_side(LAYOUTS[family]):
        coords = start_coordinators([config(ckpts[family], family, *lay) for lay in group])
        try:
            outs = ray_session.get([c.generate.remote(ps, params) for c in coords])
        finally:
            stop_coordinators(coords)
        for layout, results in zip(group, outs):
            assert [r.token_ids for r in results] == want, layout


def test_qwen3_config_fields(ckpts: dict[str, Path], tmp_path: Path) -> None:
    dense = ModelConfig.from_pretrained(str(ckpts["qwen3"]))
    assert (dense.family, dense.head_dim, dense.qk_norm, dense.attention_bias) == (
        "llama", 32, True, False)
    moe = ModelConfig.from_pretrained(str(ckpts["qwen3_moe"]))  # num_local_experts on disk
    assert (moe.family, moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (
        "qwen3_moe", 4, 2, True)
    assert (moe.shared_expert_intermediate_size, moe.mlp_only_layers) == (0, (1,))
    assert [moe.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    hf = json.loads((ckpts["qwen3"] / "config.json").read_text())
    del hf["head_dim"]  # Qwen3Config's default is 128, not hidden / heads
    assert from_json(tmp_path, hf).head_dim == 128


def from_json(tmp_path: Path, hf: dict) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return ModelConfig.from_pretrained(str(tmp_path))


def base(arch: str) -> dict:
    return {"architectures": [arch], "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}


REFUSED = [
    ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("Qwen3ForCausalLM", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
    ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                              "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.25"),
    ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias=True"),
    ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias=True"),
    ("Qwen3MoeForCausalLM", {"attention_bias": True, "num_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 32},
     "attention_bias=True"),
    ("LlamaForCausalLM", {"qk_layernorm": True}, "qk_layernorm=True"),
    ("MistralForCausalLM", {"use_qk_norm": True}, "use_qk_norm=True"),
]


@pytest.mark.parametrize("arch, fields, named", REFUSED, ids=[r[2] + "-" + r[0][:6]
                                                            for r in REFUSED])
def test_math_fields_raygraph_does_not_compute_are_refused(tmp_path: Path, arch: str,
                                                           fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=f"{named}.*not supported for {arch}"):
        from_json(tmp_path, {**base(arch), **fields})


def test_accepted_values_and_fields_hf_ignores(tmp_path: Path) -> None:
    ok = {"hidden_act": "silu", "mlp_bias": False, "partial_rotary_factor": 1.0,
          "attention_bias": False, "qk_layernorm": False}
    assert not from_json(tmp_path, {**base("LlamaForCausalLM"), **ok}).attention_bias
    # Qwen2 always biases q/k/v; Mistral has no attention bias whatever the field says
    assert from_json(tmp_path, {**base("Qwen2ForCausalLM"), "attention_bias": False}
                     ).attention_bias
    assert not from_json(tmp_path, {**base("MistralForCausalLM"), "attention_bias": True}
                         ).attention_bias
    qwen2_moe = {**base("Qwen2MoeForCausalLM"), "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32}
    assert from_json(tmp_path, qwen2_moe).attention_bias  # qkv_bias defaults to true
    assert not from_json(tmp_path, {**qwen2_moe, "qkv_bias": False}).attention_bias
