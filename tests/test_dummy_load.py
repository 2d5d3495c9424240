"""`load_format = "dummy"`: random weights from config.json alone, the same for every build
and every TP size, and the option as the CLI, keywords and TOML take it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raygraph.config import DEFAULT_MODEL, ConfigError, ModelConfig, ServeConfig, load_toml
from raygraph.model.loader import DUMMY_STD, build_model
from raygraph.model.parallel import Comm
from raygraph.serve_options import build_config
from tests.conftest import assert_close_across_shapes, free_port, loaded_worker
from tests.conftest import prefill_logits as shared_prefill_logits

CPU = torch.device("cpu")
BLOCK = 4
PROMPT = [5, 9, 33, 100, 7, 4000, 12]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model's config.json and nothing else: no weights, no tokenizer."""
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(Path(DEFAULT_MODEL) / "config.json", path)
    return path


def dummy_model(path: Path, comm: Comm | None = None) -> torch.nn.Module:
    cfg = ModelConfig.from_pretrained(str(path))
    return build_model(cfg, comm or Comm(), torch.float32, CPU, load_format="dummy")


def prefill_logits(model: torch.nn.Module, tp: int) -> torch.Tensor:
    return shared_prefill_logits(model, tp, PROMPT, BLOCK)


def test_dummy_weights_are_finite_deterministic_and_scaled(config_only: Path) -> None:
    a, b = dummy_model(config_only), dummy_model(config_only)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, t in sa.items():
        assert torch.equal(t, sb[name]), name
        assert t.isfinite().all(), name
    for name, p in a.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - DUMMY_STD) < 0.1 * DUMMY_STD, name
    logits = prefill_logits(a, 1)
    assert logits.isfinite().all() and logits.std() > 0


def _tp2_rank(rank: int, port: int, path: Path, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = dummy_model(path, Comm(dist.group.WORLD))
        torch.save(prefill_logits(model, 2), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_over_gloo_equals_tp1(config_only: Path, tmp_path: Path) -> None:
    mp.spawn(_tp2_rank, args=(free_port(), config_only, tmp_path), nprocs=2, join=True)
    want = prefill_logits(dummy_model(config_only), 1)
    for rank in range(2):
        assert_close_across_shapes(torch.load(tmp_path / f"rank{rank}.pt"), want)


def test_config_only_dir_loads_under_dummy_and_fails_clearly_under_auto(
        config_only: Path) -> None:
    from raygraph.client.connect import check_startup  # Ray: not for the spawned ranks

    model = check_startup(ServeConfig(model=str(config_only), load_format="dummy"))
    assert model.vocab_size == 4096
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in"):
        check_startup(ServeConfig(model=str(config_only)))
    cfg = ModelConfig.from_pretrained(str(config_only))
    with pytest.raises(FileNotFoundError, match=str(config_only)):
        build_model(cfg, Comm(), torch.float32, CPU)


def test_the_option_as_flag_keyword_and_toml(tmp_path: Path) -> None:
    from raygraph.cli import add_serve_args, serve_config

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert serve_config(p.parse_args(["--load-format", "dummy"])).load_format == "dummy"
    assert serve_config(p.parse_args([])).load_format == "auto"
    assert build_config({"load_format": "dummy"}).load_format == "dummy"
    toml = tmp_path / "serve.toml"
    toml.write_text('load_format = "dummy"\n')
    assert load_toml(toml).load_format == "dummy"


def test_a_bad_value_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from raygraph.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--load-format", "npz"])
    assert e.value.code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "invalid choice: 'npz'" in errors[0]
    with pytest.raises(ConfigError, match="^load_format must be 'auto' or 'dummy', got 'npz'$"):
        build_config({"load_format": "npz"})
    toml = tmp_path / "serve.toml"
    toml.write_text('load_format = "npz"\n')
    with pytest.raises(ConfigError, match="load_format") as err:
        load_toml(toml)
    assert "\n" not in str(err.value)


def test_a_hub_id_under_dummy_downloads_no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    asked: dict = {}

    def fake_download(repo: str, **kw: object) -> str:
        asked.update(kw)
        return DEFAULT_MODEL

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert build_config({"model": "org/name", "load_format": "dummy"}).model == DEFAULT_MODEL
    assert "*.safetensors" not in asked["allow_patterns"] and "*.json" in asked["allow_patterns"]
    build_config({"model": "org/name"})
    assert "*.safetensors" in asked["allow_patterns"]


def test_the_worker_builds_dummy_weights(config_only: Path) -> None:
    """The config reaches the worker's build: rank 0 in this process, on the CPU."""
    cfg = ServeConfig(model=str(config_only), device="cpu", dtype="float32",
                      load_format="dummy").resolved(0)
    worker = loaded_worker(cfg, num_blocks=8)
    want = dummy_model(config_only).state_dict()
    got = worker.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
