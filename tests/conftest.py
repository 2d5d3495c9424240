"""Shared fixtures: one Ray instance per session, tiny random HF checkpoints, GPU skips."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        for n in (2, 4):
            if f"gpu{n}" in item.keywords and gpus < n:
                item.add_marker(pytest.mark.skip(reason=f"needs {n} CUDA GPUs; {gpus} visible"))


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=6, include_dashboard=False, namespace="raygraph-tests",
             log_to_driver=False)
    yield ray
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(path: Path, arch: str, **overrides) -> Path:
    """A tiny random HF checkpoint written with save_pretrained (float32)."""
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model = getattr(transformers, arch)(cfg_cls(**kw)).eval()
    model.save_pretrained(path)
    return path


def make_gpu_llama(path: Path, num_key_value_heads: int = 2) -> Path:
    """The GPU tests' Llama: big enough for the Triton kernels' tiles, small to build."""
    return make_checkpoint(path, "LlamaForCausalLM", vocab_size=512, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                           num_key_value_heads=num_key_value_heads)


@pytest.fixture(scope="session")
def gpu_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpu_llama(tmp_path_factory.mktemp("gpu-llama"))


def randomise_caches(workers, seed: int) -> None:
    """The same random K/V contents in every worker's cache (graph and eager compared)."""
    for w in workers:
        torch.manual_seed(seed)
        for layer in w.model.attention_layers():
            layer.k_cache.normal_()
            layer.v_cache.normal_()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM",
                           rope_theta=500000.0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM",
                           tie_word_embeddings=True)
