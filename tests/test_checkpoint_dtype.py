"""`--dtype auto` follows the checkpoint's torch_dtype on cuda; one function decides, and the
worker and ServeConfig.resolved both ask it; and the capture mode ServeConfig.resolved pins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raygraph.config import DEFAULT_MODEL, ServeConfig, auto_dtype


@pytest.mark.parametrize("checkpoint, cuda", [
    ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
    ("float64", "bfloat16"),
])
def test_auto_keeps_half_precision_checkpoints_on_cuda(checkpoint: str, cuda: str) -> None:
    assert auto_dtype("cuda", checkpoint) == cuda
    assert auto_dtype("cpu", checkpoint) == "float32"


def with_torch_dtype(tmp_path: Path, value: str | None, key: str = "torch_dtype") -> str:
    model = Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("dtype", None)
    if value is not None:
        cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))
    return str(model)


@pytest.mark.parametrize("value, key, cuda", [
    ("float16", "torch_dtype", "float16"), ("bfloat16", "dtype", "bfloat16"),
    ("float32", "torch_dtype", "bfloat16"), (None, "torch_dtype", "bfloat16"),
])
def test_the_config_resolves_from_config_json(tmp_path: Path, value, key, cuda) -> None:
    cfg = ServeConfig(model=with_torch_dtype(tmp_path, value, key))
    assert cfg.weights_dtype("cuda") == cuda
    assert cfg.weights_dtype("cpu") == "float32"
    assert cfg.resolved(num_gpus=1).dtype == cuda
    assert cfg.resolved(num_gpus=0).dtype == "float32"


def test_an_explicit_dtype_wins(tmp_path: Path) -> None:
    cfg = ServeConfig(model=with_torch_dtype(tmp_path, "float16"), dtype="bfloat16")
    assert cfg.weights_dtype("cuda") == "bfloat16" == cfg.resolved(num_gpus=1).dtype
    assert ServeConfig(dtype="float16").weights_dtype("cpu") == "float16"


def test_the_worker_asks_the_config() -> None:
    import torch

    from raygraph.worker.worker import Worker

    assert Worker(ServeConfig(device="cpu"), 0).dtype == torch.float32
    assert Worker(ServeConfig(device="cpu", dtype="bfloat16"), 0).dtype == torch.bfloat16


def test_auto_capture_is_background_on_cuda_and_lazy_on_cpu() -> None:
    """A CPU capture records no graph: warming every bucket up front would only compete with
    the requests; an explicit mode is kept on either device."""
    from raygraph.config import GraphConfig

    cfg = ServeConfig()
    assert cfg.graph.capture == "auto"
    assert cfg.resolved(num_gpus=1).graph.capture == "background"
    assert cfg.resolved(num_gpus=0).graph.capture == "lazy"
    given = ServeConfig(graph=GraphConfig(capture="background"))
    assert given.resolved(num_gpus=0).graph.capture == "background"
