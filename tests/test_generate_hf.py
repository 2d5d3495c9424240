"""Greedy tokens through the whole serving path (coordinator, Ray workers, scheduler,
paged KV cache, chunked prefill) equal HF transformers' on tiny random checkpoints."""

from __future__ import annotations

import random

import pytest

from raygraph.client.connect import start_coordinator
from raygraph.config import (
    CacheConfig,
    GraphConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)
from raygraph.protocol import SamplingParams
from tests.conftest import start_coordinators, stop_coordinators
from tests.hf_ref import hf_greedy

MAX_TOKENS = 12


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # lengths straddle the 16-token chunk budget and the 4-token blocks; 150: ten chunks
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 4, 5, 17, 40, 150)]


def config(model, tp: int, mode: str = "graph") -> ServeConfig:
    return ServeConfig(
        model=str(model), device="cpu", parallel=ParallelConfig(tp=tp),
        cache=CacheConfig(block_size=4), scheduler=SchedulerConfig(max_num_batched_tokens=16),
        graph=GraphConfig(mode=mode), coordinator_name=f"hf-{model.name}-tp{tp}-{mode}",
    )


def serve(ray, model, tp: int, mode: str = "graph"):
    return start_coordinator(config(model, tp, mode))


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen2"])
def test_greedy_matches_hf_tp1_and_tp2(ray_session, ckpt: str, request: pytest.FixtureRequest):
    model = request.getfixturevalue(ckpt)
    ps = prompts(len(ckpt))
    expected = hf_greedy(model, ps, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    coords = start_coordinators([config(model, tp) for tp in (1, 2)])
    try:
        outs = ray_session.get([c.generate.remote(ps, params) for c in coords])
    finally:
        stop_coordinators(coords)
    for tp, results in zip((1, 2), outs):
        got = [r.token_ids for r in results]
        assert got == expected, f"tp={tp}"
        assert all(r.finish_reason == "length" for r in results)


@pytest.mark.parametrize("kv_heads, tp, mode", [
    (1, 2, "graph"), pytest.param(2, 4, "graph", marks=pytest.mark.slow),
    pytest.param(1, 4, "graph", marks=pytest.mark.slow),
    pytest.param(1, 4, "eager", marks=pytest.mark.slow)])
def test_kv_heads_replicated_when_tp_exceeds_them(ray_session, tmp_path, kv_heads, tp, mode):
    """TP above the KV head count: each rank keeps the KV head its query heads read (the
    loader slices K/V by shard, the cache and kernels size from the per-rank count)."""
    from tests.conftest import make_checkpoint

    model = make_checkpoint(tmp_path / f"kv{kv_heads}", "LlamaForCausalLM",
                            num_attention_heads=4, num_key_value_heads=kv_heads)
    ps = prompts(kv_heads + tp)
    coord = serve(ray_session, model, tp, mode)
    try:
        results = ray_session.get(coord.generate.remote(
            ps, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    finally:
        ray_session.get(coord.shutdown.remote())
        ray_session.kill(coord)
    assert [r.token_ids for r in results] == hf_greedy(model, ps, MAX_TOKENS)
