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
import threading
import time
from pathlib import Path

import pytest
import ray

from orchestrator.job import ElasticJob
from testkit.harness import free_port

REPO = Path(__file__).resolve().parents[2]


DASHBOARD_NEEDS = ("aiohttp_cors", "opencensus", "colorful", "smart_open", "virtualenv")
MISSING = [m for m in DASHBOARD_NEEDS if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"`ray job submit` needs Ray's dashboard (ray[default]); "
                                                      f"missing: {', '.join(MISSING)}")


class Head:
    """`ray start --head --block` in a temp dir of its own, its output read as it comes."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
        self.port, dashboard = free_port(), free_port()
        self.dashboard = f"http://127.0.0.1:{dashboard}"
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        cmd = ["ray", "start", "--head", "--block", f"--port={self.port}", f"--temp-dir={self.temp_dir}", "--num-cpus=4",
               "--node-ip-address=127.0.0.1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={free_port()}",
               f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
               f"--metrics-export-port={free_port()}", f"--ray-client-server-port={free_port()}", "--disable-usage-stats"]
        self.process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.output: list[str] = []
        threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True).start()

    def up(self, timeout: float) -> bool:
        """Whether the head started (`ray start` said so: its raylet registered) and its dashboard
        answers, within `timeout`; False as soon as `ray start` exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if any("Ray runtime started" in line for line in self.output) and subprocess.run(
                    ["ray", "job", "list", "--address", self.dashboard], env=_client_env(),
                    capture_output=True).returncode == 0:
                return True
            time.sleep(1)
        return False

    def stop(self) -> None:
        ended = self.process.poll() is not None
        self.process.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ended = True
        if ended:  # it did not stop them: what is left of its session goes
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def head_node():
    """A head node with a dashboard. Its start is tried up to 3 times: on this 2-core machine, beside
    the other test process, a head's raylet has given up on its runtime-env agent within Ray's fixed 30 s
    node start, and `ray start` exited ("The current node timed out during startup")."""
    for attempt in range(3):
        head = Head()
        if head.up(timeout=90):
            break
        print(f"head node start {attempt + 1} failed: " + "".join(head.output[-8:]))
        head.stop()
    else:
        pytest.fail("the head node did not start in 3 tries")
    yield {"gcs": f"127.0.0.1:{head.port}", "dashboard": head.dashboard, "head": head}
    head.stop()


def _client_env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_AUTH_MODE", "token")  # the token file Ray generated is found by default
    return env


def _head_logs(head: Head) -> str:
    """Why an attach could not reach the head: `ray start --block`'s own output once it ended (it names
    a subprocess that exited unexpectedly, then stops the others), and the tails of the head's logs."""
    lines = []
    if head.process.poll() is not None:
        lines += [f"--- ray start --block exited with {head.process.returncode}:"] + \
            "".join(head.output).splitlines()[-30:]
    logs = Path(head.temp_dir) / "session_latest" / "logs"
    for name in ("gcs_server.err", "raylet.out", "raylet.err", "dashboard.err", "dashboard_agent.err"):
        if (logs / name).exists():
            lines += [f"--- {name}"] + (logs / name).read_text(errors="replace").splitlines()[-12:]
    return "\n".join(lines)


def test_job_submit_trains_user_workload_and_is_attachable(head_node, tmp_path):
    """The workload holds its 10th step until the test, attached, has seen the job RUNNING: the job
    cannot end before the attach (a gate file, not a race with the job's length)."""
    workdir = tmp_path / "work"
    shutil.copytree(REPO / "tests" / "workloads", workdir)
    gate = tmp_path / "attached"
    config = (workdir / "custom.yaml").read_text().replace("name: custom-workload", "name: submitted")
    (workdir / "custom.yaml").write_text(config.replace("params: {n: 1200}", f"params: {{n: 1200, hold_at_call: 10, "
                                                                             f"hold_gate: '{gate}'}}")
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
                socket.create_connection(("127.0.0.1", head_node["head"].port), timeout=2).close()
                job = ElasticJob.attach("submitted", address=head_node["gcs"])
                status = job.status()
                if status.state == "RUNNING" and status.step > 0:
                    break
            except Exception as err:  # noqa: BLE001 - not started yet
                error = err
            time.sleep(0.5)
        assert status is not None and status.step > 0, \
            f"could not attach to the running job: {error}\n{_head_logs(head_node['head'])}"
        print(f"attached while running: {status.state} step {status.step} world {status.world_size}")
        assert [m.slot for m in status.members] == ["w0", "w1"]
        gate.touch()
        out, _ = submit.communicate(timeout=240)
        print(out[-2500:])
        assert submit.returncode == 0
        assert "succeeded" in out.lower() and "FINISHED: submitted" in out
    finally:
        gate.touch()  # a failed assertion must not leave the job held on the head node
        if submit.poll() is None:
            submit.kill()
        ray.shutdown()
