"""The deploy path for real, as the README writes it: a local Ray head started with Ray's
default settings, `ray job submit`, clients by address, `raygraph stop`.

Ray 2.52+ turns token authentication on for `ray start --head` when the machine holds a
token (~/.ray/auth_token), so the path runs twice: in a home with a token (auth on) and in
one without (auth off). Nothing is set by hand beyond what the README's commands say.
"""

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
BIN = Path(sys.executable).parent


def run(*cmd: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(params=["token-auth", pytest.param("no-auth", marks=pytest.mark.slow)])
def ray_head(request, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    if request.param == "token-auth":
        gen = run(str(BIN / "ray"), "get-auth-token", "--generate", env=env)
        assert gen.returncode == 0, gen.stderr
        assert (home / ".ray" / "auth_token").is_file()
    port, dash = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rg", dir="/tmp")  # Ray's socket paths must stay short
    # on SIGTERM a `ray start --block` head drains its node first (up to 30 s by default): the
    # teardown stops it at once
    head_env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=3", "--block",
         # fixed default ports would clash with the test session's own Ray on this machine
         *(f"--{flag}={free_port()}" for flag in (
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "ray-client-server-port")),
         f"--temp-dir={temp_dir}"],
        env=head_env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "env": env,
               "auth": request.param == "token-auth", "head": head}
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit_job(ray_head: dict) -> subprocess.CompletedProcess:
    """The README's submit lines. Ray's own `ray job submit` sends no token unless
    RAY_AUTH_MODE=token is set, and fails in token mode where there is no token, so on a
    cluster with auth the README submits with `raygraph submit` (which sets it when this
    machine holds a token); without auth, plain `ray job submit` is the flow."""
    if ray_head["auth"]:
        cmd = [str(BIN / "raygraph"), "submit", "--address", ray_head["dashboard"],
               "--python", sys.executable, "--", "--num-kv-blocks", "64", "--port", "0"]
    else:
        cmd = [str(BIN / "ray"), "job", "submit", "--address", ray_head["dashboard"],
               "--working-dir", ".", "--", sys.executable, "deploy/job.py",
               "--num-kv-blocks", "64", "--port", "0"]  # HTTP on any free port
    submit = None
    deadline = time.time() + 90
    while time.time() < deadline:  # the dashboard's job API comes up a little after the head
        submit = run(*cmd, env=ray_head["env"])
        out = submit.stderr + submit.stdout
        if submit.returncode == 0 or not ("Connection" in out or "try again later" in out):
            break
        time.sleep(2)
    return submit


def test_job_submit_then_clients_by_address(ray_head):
    env, gcs = ray_head["env"], ray_head["gcs"]
    submit = submit_job(ray_head)
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    assert "serving" in submit.stdout and gcs.split(":")[1] in submit.stdout
    if ray_head["auth"]:  # the head really requires the token: a client without it fails
        # the head is up by now: a refusal is final, so two tries instead of Ray's 20 (~1 s
        # apart) are enough
        anon = run(sys.executable, "-c", f"import ray; ray.init(address={gcs!r})",
                   env={**env, "RAY_AUTH_MODE": "disabled", "RAY_NUM_REDIS_GET_RETRIES": "2"},
                   timeout=120)
        assert anon.returncode != 0 and "InvalidAuthToken" in anon.stderr, anon.stderr[-2000:]

    client = run(sys.executable, "deploy/client.py", "--address", gcs,
                 "--max-tokens", "8", "The import statement", "A class", env=env)
    assert client.returncode == 0, client.stderr[-2000:]
    lines = client.stdout.splitlines()
    assert lines[0].startswith("The import statement") and "8 tokens" in lines[0]
    assert lines[-1].startswith("stream:") and len(lines[-1]) > len("stream: ")

    gen = run(str(BIN / "raygraph"), "generate", "--address", gcs, "--max-tokens", "4",
              "--top-k", "5", "--temperature", "0.8", "--seed", "1", "A class", env=env)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("A class") and len(gen.stdout.strip()) > len("A class")

    stop = run(str(BIN / "raygraph"), "stop", "--address", gcs, env=env)
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert "coordinator stopped" in stop.stdout

    # the coordinator is gone: the client says which cluster it reached, in one line
    again = run(str(BIN / "raygraph"), "stop", "--address", gcs, env=env)
    assert again.returncode == 1
    err = again.stderr.strip().splitlines()
    port = gcs.split(":")[1]  # the cluster names itself by its node IP
    assert err[-1].startswith("raygraph: error: no coordinator named") and f":{port}" in err[-1]
    assert not any("Traceback" in ln for ln in err)
