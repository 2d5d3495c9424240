"""The CLI as a user meets it: one line per error, exit 2 for bad input, 1 for a failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import raygraph as raygraph_package
from raygraph.config import DEFAULT_MODEL, ConfigError, load_toml

RAYGRAPH = str(Path(sys.executable).parent / "raygraph")


def raygraph(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([RAYGRAPH, *args], capture_output=True, text=True, timeout=timeout)


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """The error line; nothing on stderr looks like a traceback."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert not any("Traceback" in ln or ln.startswith("  File ") for ln in lines), p.stderr
    errors = [ln for ln in lines if ln.startswith("raygraph: error: ")]
    assert len(errors) == 1, p.stderr
    return errors[0]


@pytest.fixture
def bad_models(tmp_path: Path) -> dict[str, Path]:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return {"broken": broken, "gpt2": gpt2, "missing": tmp_path / "nope"}


@pytest.mark.parametrize("case, args, cause", [
    ("missing", ["--model", "{missing}"], "is not a directory"),
    ("broken", ["--model", "{broken}"], "config.json is not valid JSON"),
    ("gpt2", ["--model", "{gpt2}"], "unsupported architecture ['GPT2LMHeadModel']"),
    ("tp", ["--tp", "3"], "tp=3 must divide num_heads=4"),
    ("detach", ["--detach"], "--detach needs a Ray cluster"),
    ("port", ["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    ("seqs", ["--max-num-seqs", str(10**20)], "max_num_seqs must be in [1, 65536]"),
    ("len", ["--max-model-len", "-5"], "max_model_len must be >= 1"),
    ("bytes", ["--max-request-bytes", "0"], "max_request_bytes must be >= 1"),
])
def test_bad_startup_input_is_one_line_exit_2(bad_models, case, args, cause):
    """Refused before anything starts: no coordinator is left serving (with --detach it
    would outlive the command)."""
    args = [a.format(**{k: str(v) for k, v in bad_models.items()}) for a in args]
    p = raygraph("serve", *args)
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert cause in line
    assert "coordinator" not in p.stdout, p.stdout
    if case in bad_models:
        assert str(bad_models[case]) in line  # the file or directory is named


@pytest.mark.parametrize("flag, value", [("--max-tokens", "0"), ("--temperature", "nan")])
def test_bad_demo_sampling_flags_are_one_line_before_ray_starts(flag, value):
    p = raygraph("demo", "--device", "cpu", flag, value, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"$.{flag[2:].replace('-', '_')}" in p.stderr


@pytest.mark.parametrize("args", [["serve", "--dtype", "bogus"], ["generate"], ["bogus"], []])
def test_usage_errors_are_one_line_exit_2(args):
    p = raygraph(*args)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stderr.startswith("raygraph: error: ") and "--help" in p.stderr


def test_an_unreachable_cluster_address_is_one_line_at_once():
    p = raygraph("generate", "--address", "127.0.0.1:1", "hello", timeout=60)
    assert p.returncode == 1
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in one_error_line(p)


def test_offload_budget_below_floor_is_one_line_exit_2(ray_session):
    """This one is found by a worker after loading: the cause crosses two actors. The CLI
    joins the session's Ray (--address): a Ray of its own would add its start and stop."""
    address = ray_session.get_runtime_context().gcs_address
    p = raygraph("serve", "--offload-budget", "1000", "--model", DEFAULT_MODEL,
                 "--address", address)
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert "offload budget 1000 bytes is below the floor: at least" in line
    assert "GPU" not in line  # a CPU run is not told about a GPU


def test_help_lists_every_command_and_shows_defaults():
    top = raygraph("--help").stdout
    for cmd in ("demo", "serve", "generate", "check-capture", "submit", "stop", "sleep", "wake",
                "scale"):
        assert cmd in top
    serve = raygraph("serve", "--help").stdout
    assert "(default: 1)" in serve and "(default: 16)" in serve  # --tp, --block-size
    gen = raygraph("generate", "--help").stdout
    for flag in ("--top-p", "--top-k", "--stop", "--seed", "--stream"):
        assert flag in gen


def test_version():
    p = raygraph("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"raygraph {raygraph_package.__version__}\n"


TOP_LEVEL = ("valid: model, tokenizer, device, dtype, load_format, quantization, seed, "
             "coordinator_name, namespace, step_timeout_s, "
             "[parallel], [cache], [scheduler], [graph], [offload], [lora], [replica], "
             "[speculative]")


@pytest.mark.parametrize("text, cause", [
    ("max_num_seqs = 8\n",
     f"unknown key 'max_num_seqs' at the top level (it belongs in [scheduler]); {TOP_LEVEL}"),
    ("[scheduler]\nmax_num_seqs = 8\nmax_num_seq = 8\n",
     "unknown key 'max_num_seq' in [scheduler]; valid: max_num_seqs, max_num_batched_tokens, "
     "max_model_len"),
    ('[grpah]\nmode = "eager"\n', f"unknown key 'grpah' at the top level; {TOP_LEVEL}"),
])
def test_config_file_refuses_unknown_keys(tmp_path, text, cause):
    toml = tmp_path / "serve.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_toml(toml)
    assert str(e.value) == f"{toml}: {cause}"


def test_config_file_with_an_unknown_key_is_one_line_exit_2(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text("[cache]\nblock_size = 8\n[scheduler]\nmax_num_seq = 8\n")
    p = raygraph("serve", "--config", str(toml), "--port", "0")
    assert p.returncode == 2, p.stderr
    assert "unknown key 'max_num_seq' in [scheduler]" in one_error_line(p)


def test_a_draft_model_that_cannot_draft_is_one_line_exit_2(tmp_path):
    """Refused before anything starts: another vocabulary, a missing directory, a head
    without its directory, an unknown speculative method."""
    from tests.conftest import make_checkpoint

    other = make_checkpoint(tmp_path / "v256", "LlamaForCausalLM", num_hidden_layers=1)
    for spec, cause in (
            (f'{{"method": "draft", "model": "{other}"}}', "has a vocabulary of 256, the "
             "target 4096: a draft model must share the target's tokenizer"),
            ('{"method": "draft", "model": "/nonexistent"}',
             "draft model: model path '/nonexistent' is not a directory"),
            ('{"method": "eagle3"}', "a speculative 'model' goes with methods 'draft' and "
             "'eagle3' and only with them, got method 'eagle3' and model ''"),
            ('{"method": "medusa"}', "Invalid enum value 'medusa'")):
        p = raygraph("serve", "--speculative-config", spec, "--port", "0")
        assert p.returncode == 2, p.stderr
        assert cause in one_error_line(p)
