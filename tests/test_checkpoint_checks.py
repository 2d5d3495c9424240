"""A damaged or mismatched checkpoint is refused by name: from its headers in the driver
before Ray starts (check_startup, the CLI), and its values where a worker loads it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raygraph.client.connect import check_startup
from raygraph.config import DEFAULT_MODEL, ModelConfig, ServeConfig
from raygraph.model.checkpoint import CheckpointError
from raygraph.model.loader import build_model
from raygraph.model.parallel import Comm

RAYGRAPH = str(Path(sys.executable).parent / "raygraph")
FILE = "model.safetensors"
UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The built-in model, to damage."""
    return Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))


def rewrite(path: Path, name: str, tensor: torch.Tensor | None) -> None:
    tensors = load_file(str(path / FILE))
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, str(path / FILE), metadata={"format": "pt"})


def check(path: Path) -> None:
    check_startup(ServeConfig(model=str(path)))


def load(path: Path, dtype: torch.dtype = torch.float32) -> None:
    build_model(ModelConfig.from_pretrained(str(path)), Comm(), dtype, torch.device("cpu"))


def test_the_built_in_model_passes_in_well_under_a_second() -> None:
    check(Path(DEFAULT_MODEL))  # imports done
    t0 = time.perf_counter()
    check(Path(DEFAULT_MODEL))
    assert time.perf_counter() - t0 < 0.5


def test_truncated_file(copy: Path) -> None:
    data = (copy / FILE).read_bytes()
    (copy / FILE).write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"in {FILE}: .*the file is truncated"):
        check(copy)


def test_corrupted_header(copy: Path) -> None:
    data = bytearray((copy / FILE).read_bytes())
    data[8:40] = b"#" * 32
    (copy / FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{FILE}: its header is not valid JSON"):
        check(copy)


def test_not_safetensors(copy: Path) -> None:
    (copy / FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=rf"{FILE}: not a safetensors file, or truncated"):
        check(copy)


def test_missing_tensor(copy: Path) -> None:
    rewrite(copy, UP, None)
    with pytest.raises(CheckpointError, match=rf"lacks tensors: \['{UP}'\]"):
        check(copy)


def test_wrong_shape(copy: Path) -> None:
    rewrite(copy, UP, torch.zeros(768, 128, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=rf"{UP} in {FILE}: shape \(768, 128\), the "
                                              r"config implies \(768, 256\)"):
        check(copy)


def test_int8_where_floats_are_expected(copy: Path) -> None:
    rewrite(copy, UP, torch.ones(768, 256, dtype=torch.int8))
    with pytest.raises(CheckpointError, match=rf"{UP} in {FILE}: stored as I8"):
        check(copy)
    with pytest.raises(CheckpointError, match=rf"{UP} in {FILE}: stored as I8"):
        load(copy)


def test_nan_weights_are_refused_at_load(copy: Path) -> None:
    w = load_file(str(copy / FILE))[UP].clone()
    w[3, :12] = float("nan")
    rewrite(copy, UP, w)
    check(copy)  # the header is fine: the values are the worker's to check
    with pytest.raises(CheckpointError, match=rf"^{UP} in {FILE}: 12 non-finite values$"):
        load(copy)


def test_values_past_the_model_dtype_are_refused_at_load(copy: Path) -> None:
    w = load_file(str(copy / FILE))[UP].clone()
    w[0, :3] = 1e6  # a bfloat16 value, inf in float16
    rewrite(copy, UP, w)
    load(copy, torch.bfloat16)
    with pytest.raises(CheckpointError, match=rf"{UP} in {FILE}: 3 values out of the range "
                                              "of float16"):
        load(copy, torch.float16)


@pytest.mark.parametrize("damage", ["truncate", "int8"])
def test_cli_refuses_before_ray_starts(copy: Path, damage: str) -> None:
    if damage == "truncate":
        (copy / FILE).write_bytes((copy / FILE).read_bytes()[:-1000])
    else:
        rewrite(copy, UP, torch.ones(768, 256, dtype=torch.int8))
    p = subprocess.run([RAYGRAPH, "serve", "--model", str(copy), "--no-http"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("raygraph: error: "), p.stderr
    assert FILE in lines[0] and "Started a local Ray instance" not in p.stderr + p.stdout
