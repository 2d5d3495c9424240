"""raygraph's Triton kernels compile for sm_90 (H100/H200) on any machine: Triton's front end
and ptxas reject what its interpreter (tests/test_triton_*interpret.py) runs as plain
Python, such as a call to a function that is not a kernel helper. A kernel launched with
programmatic dependent launch must also let the next kernel launch before it waits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton", reason="needs the triton package")
    ptxas = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"no ptxas in the triton package ({ptxas})")
    env = dict(os.environ, TRITON_INTERPRET="0")  # this process runs kernels interpreted
    root = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-m", "tests.triton_aot"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 56, done.stdout
