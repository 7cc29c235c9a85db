"""`ray job submit` against a head node this test starts (and stops) itself, with a user
workload shipped in the working directory; the test attaches to the job by name while it runs."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import ray

from actors.testing import free_port
from orchestrator.job import ElasticJob

REPO = Path(__file__).resolve().parents[2]


DASHBOARD_NEEDS = ("aiohttp_cors", "opencensus", "colorful", "smart_open", "virtualenv")
MISSING = [m for m in DASHBOARD_NEEDS if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"`ray job submit` needs Ray's dashboard (ray[default]); "
                                                      f"missing: {', '.join(MISSING)}")


@pytest.fixture
def head_node():
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    port, dashboard = free_port(), free_port()
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    cmd = ["ray", "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp_dir}", "--num-cpus=4",
           "--node-ip-address=127.0.0.1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--ray-client-server-port={free_port()}", "--disable-usage-stats"]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    dashboard_url = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 90
    while subprocess.run(["ray", "job", "list", "--address", dashboard_url], env=_client_env(),
                         capture_output=True).returncode != 0:
        assert head.poll() is None, head.stdout.read()
        assert time.monotonic() < deadline, "head node did not come up"
        time.sleep(1)
    yield {"gcs": f"127.0.0.1:{port}", "dashboard": dashboard_url, "temp_dir": temp_dir, "process": head}
    head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _client_env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "token")  # the token file Ray generated is found by default
    return env


def _head_logs(head_node: dict) -> str:
    """Why an attach could not reach the head: `ray start --block`'s own output once it ended (it names
    a subprocess that exited unexpectedly, then stops the others), and the tails of the head's logs."""
    lines, head = [], head_node["process"]
    if head.poll() is not None:
        lines += [f"--- ray start --block exited with {head.returncode}:"] + head.stdout.read().splitlines()[-30:]
    logs = Path(head_node["temp_dir"]) / "session_latest" / "logs"
    for name in ("gcs_server.err", "raylet.out", "raylet.err", "dashboard.err", "dashboard_agent.err"):
        if (logs / name).exists():
            lines += [f"--- {name}"] + (logs / name).read_text(errors="replace").splitlines()[-12:]
    return "\n".join(lines)


def test_job_submit_trains_user_workload_and_is_attachable(head_node, tmp_path):
    workdir = tmp_path / "work"
    shutil.copytree(REPO / "tests" / "workloads", workdir)
    config = (workdir / "custom.yaml").read_text().replace("name: custom-workload", "name: submitted")
    (workdir / "custom.yaml").write_text(config.replace("max_steps: 60", "max_steps: 400")
                                         + f"run_dir: {tmp_path / 'runs'}\n")
    submit = subprocess.Popen(
        ["ray", "job", "submit", "--address", head_node["dashboard"], "--working-dir", str(workdir), "--",
         "python", "-m", "orchestrator", "run", "custom.yaml"],
        env=_client_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    was_connected = ray.is_initialized()
    if was_connected:
        ray.shutdown()  # one process holds one Ray connection: attach to the test's own head node
    try:
        deadline = time.monotonic() + 120
        status, error = None, None
        while time.monotonic() < deadline:
            try:
                # Ray's own connect retries an unreachable GCS for minutes (20 tries of 35 s here): a
                # closed port fails this try at once, and the loop's deadline holds.
                socket.create_connection(("127.0.0.1", int(head_node["gcs"].rpartition(":")[2])), timeout=2).close()
                job = ElasticJob.attach("submitted", address=head_node["gcs"])
                status = job.status()
                if status.state == "RUNNING" and status.step > 0:
                    break
            except Exception as err:  # noqa: BLE001 - not started yet
                error = err
                if ray.is_initialized():
                    ray.shutdown()
            time.sleep(0.5)
        assert status is not None and status.step > 0, \
            f"could not attach to the running job: {error}\n{_head_logs(head_node)}"
        print(f"attached while running: {status.state} step {status.step} world {status.world_size}")
        assert [m.slot for m in status.members] == ["w0", "w1"]
        out, _ = submit.communicate(timeout=240)
        print(out[-2500:])
        assert submit.returncode == 0
        assert "succeeded" in out.lower() and "FINISHED: submitted" in out
    finally:
        if submit.poll() is None:
            submit.kill()
        ray.shutdown()
