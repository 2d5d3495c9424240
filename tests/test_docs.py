"""Every fenced code block in README.md and docs/*.md runs in the tests, so an example cannot
go stale unseen. A block that cannot run in CI says so to its readers: the nearest non-empty
line before it starts with "Needs " ("Needs a CUDA GPU:"), and it is skipped with that line as
the reason. A ```text block (a drawing, a table, output) is not code. Any other block runs
here (python in a fresh interpreter, toml through raygraph's config loader, shell through
bash), or in the test RUN_ELSEWHERE names for it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from raygraph.config import load_toml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"", "bash", "sh", "console", "shell"}
BIN = Path(sys.executable).parent
TIMEOUT_S = 240  # the README's LLM block starts a Ray and serves on CPU: ~60 s on 2 cores
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^`\s]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's, 1-based
    lang: str
    code: str
    needs: str | None  # the "Needs ..." line before it, if any

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the "Needs " line right before it, if any."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.groups()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence) and set(lines[j].strip()) == {fence[0]}),
                   len(lines))
        before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        blocks.append(Block(page, i + 1, lang.lower(), textwrap.dedent("\n".join(
            lines[i + 1:end])), before if before.startswith("Needs ") else None))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in read_blocks(page) if b.lang != "text"]

# Blocks another test runs as they are, with checks of its own: a line the block holds ->
# that test. The README's LLM block starts a private Ray and serves on CPU (~30 s on 2
# cores); test_llm runs it and also checks its tokens and that the Ray it started is gone.
RUN_ELSEWHERE = {
    "with LLM() as llm:":
        "tests/test_llm.py::test_the_readme_block_starts_a_private_ray_and_stops_it",
}


def block_holding(line: str) -> Block:
    """The one block with `line` among its lines (stripped)."""
    found = [b for b in BLOCKS if any(ln.strip().startswith(line) for ln in b.code.splitlines())]
    assert len(found) == 1, f"{len(found)} blocks hold {line!r}: {[str(b) for b in found]}"
    return found[0]


def block_env() -> dict[str, str]:
    """This interpreter's environment for the commands, as the docs' `.venv` would give, and
    no Ray address: each block starts its own Ray, apart from any the tests run."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run(argv: list[str], block: Block) -> None:
    done = subprocess.run(argv, cwd=ROOT, env=block_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, (f"{block} exited {done.returncode}\n{block.code}\n"
                                  f"--- stderr ---\n{done.stderr[-4000:]}")


def test_pages_have_blocks() -> None:
    assert len(BLOCKS) > 10 and any(b.needs is None for b in BLOCKS)
    for line in RUN_ELSEWHERE:
        assert block_holding(line).needs is None  # it runs, there


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block(block: Block, tmp_path: Path) -> None:
    if block.needs:
        pytest.skip(f"{block}: {block.needs.rstrip(':')}")
    elsewhere = [test for line, test in RUN_ELSEWHERE.items() if block is block_holding(line)]
    if elsewhere:
        pytest.skip(f"{block}: runs in {elsewhere[0]}")
    if block.lang == "python":
        run([sys.executable, "-c", block.code], block)
    elif block.lang == "toml":
        path = tmp_path / "block.toml"
        path.write_text(block.code)
        load_toml(path)
    elif block.lang in SHELLS:
        code = re.sub(r"(?<![\w./])\.venv/bin/", f"{BIN}/", block.code)
        run(["bash", "-euo", "pipefail", "-c", code], block)
    else:
        pytest.fail(f"{block}: a ```{block.lang} block cannot run here; put a line saying "
                    "what it needs (\"Needs ...\") right before it, or mark it ```text")
