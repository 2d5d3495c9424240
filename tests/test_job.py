"""The deploy path for real: a local Ray head, `ray job submit`, a client by address."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ray_head():
    port, dash = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rg", dir="/tmp")  # Ray's socket paths must stay short
    # a private head on loopback: no token auth (Ray 2.60 turns it on when ~/.ray has a token)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    bindir = Path(sys.executable).parent
    head = subprocess.Popen(
        [str(bindir / "ray"), "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=3", "--block",
         # fixed default ports would clash with the test session's own Ray on this machine
         *(f"--{flag}={free_port()}" for flag in (
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "ray-client-server-port")),
         f"--temp-dir={temp_dir}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "env": env,
               "bin": bindir}
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submit_then_client_by_address(ray_head):
    env, ray_bin = ray_head["env"], str(ray_head["bin"] / "ray")
    submit = None
    deadline = time.time() + 90
    while time.time() < deadline:  # the dashboard's job API comes up a little after the head
        submit = run(ray_bin, "job", "submit", "--address", ray_head["dashboard"],
                     "--working-dir", ".", "--", sys.executable, "deploy/job.py",
                     "--num-kv-blocks", "64", env=env)
        out = submit.stderr + submit.stdout
        if submit.returncode == 0 or not ("Connection" in out or "try again later" in out):
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    assert "serving" in submit.stdout

    client = run(sys.executable, "deploy/client.py", "--address", ray_head["gcs"],
                 "--max-tokens", "8", "The import statement", "A class", env=env)
    assert client.returncode == 0, client.stderr[-2000:]
    lines = client.stdout.splitlines()
    assert lines[0].startswith("The import statement") and "8 tokens" in lines[0]
    assert lines[-1].startswith("stream:") and len(lines[-1]) > len("stream: ")

    stop = run(sys.executable, "-m", "raygraph.cli", "stop", "--address", ray_head["gcs"], env=env)
    assert stop.returncode == 0, stop.stderr[-2000:]
