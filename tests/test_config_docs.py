"""docs/configuration.md is what scripts/config_docs.py writes from raygraph/config.py today,
and its example file loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from raygraph.config import load_toml

ROOT = Path(__file__).resolve().parent.parent


def config_docs():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" /
                                                  "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_current():
    docs = config_docs()
    assert docs.PAGE.read_text() == docs.render(), \
        "docs/configuration.md is stale: run `python scripts/config_docs.py`"


def test_every_field_has_a_meaning():
    rows = [ln for ln in config_docs().render().splitlines() if ln.startswith("| `")]
    assert len(rows) > 40
    assert [ln.split("|")[1] for ln in rows if ln.rstrip().endswith("|  |")] == []


def test_the_example_file_loads_with_its_values():
    cfg = load_toml(ROOT / "docs" / "serve.toml")
    assert cfg.scheduler.max_num_seqs == 128 and cfg.scheduler.max_num_batched_tokens == 1024
    assert cfg.graph.capture == "background"
