"""A second start under a job's name never destroys that job: it replaces only a coordinator that
positively reports a terminal state, and otherwise refuses in one line naming the job, what it is and
how to stop it. Stand-ins for the old coordinator are detached actors under the job's name in the
orchestrator's namespace (the mechanism is Ray's: a named actor, its answer or its silence)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from core.schema import NameTaken
from orchestrator import coordinator_handle
from orchestrator.config import config_from_dict
from orchestrator.connection import NAMESPACE
from orchestrator.coordinator_handle import Prior, prior_job
from orchestrator.job import ElasticJob

REPO = Path(__file__).resolve().parents[2]


@ray.remote(num_cpus=0)
class StandIn:
    """An old coordinator: answers `status` with `state`, or (state None) not until released."""

    def __init__(self, state: str | None) -> None:
        self.state = state
        self.released = asyncio.Event()

    async def status(self) -> dict:
        if self.state is None:
            await self.released.wait()
        return {"state": self.state or "RUNNING", "step": 42}

    async def release(self) -> None:
        self.released.set()

    async def ping(self) -> str:
        return "alive"


def config(name: str) -> dict:
    return {"name": name, "seed": 0, "workers": {"count": 1, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 8},
            "stop": {"max_steps": 3}, "eval_every": 0}


def stand_in(name: str, state: str | None):
    actor = StandIn.options(name=name, namespace=NAMESPACE, lifetime="detached").remote(state)
    assert ray.get(actor.ping.remote(), timeout=60) == "alive"
    return actor


@pytest.mark.parametrize("state", [None, "RUNNING", "PAUSED"], ids=["slow to answer", "running", "paused"])
def test_a_start_under_a_live_or_silent_jobs_name_refuses_and_leaves_it_alone(run_root, monkeypatch, state):
    monkeypatch.setattr(coordinator_handle, "STATUS_TIMEOUT_S", 2.0)  # the silent one: its status never comes
    name = f"dup-{(state or 'slow').lower()}"
    old = stand_in(name, state)
    try:
        with pytest.raises(NameTaken) as err:
            ElasticJob(config_from_dict(config(name))).start()
        message = str(err.value)
        print(message)
        assert "\n" not in message and repr(name) in message and f"python -m orchestrator stop {name}" in message
        assert ("not answering" in message) if state is None else (f"{state} at step 42" in message)
        assert ray.get(old.ping.remote(), timeout=30) == "alive", "the start killed the job it refused to replace"
    finally:
        ray.get(old.release.remote())
        ray.kill(old, no_restart=True)


def test_a_coordinator_that_reports_an_end_is_replaced(run_root):
    name = "dup-ended"
    old = stand_in(name, "FINISHED")
    job = ElasticJob(config_from_dict(config(name))).start()
    result = job.wait(timeout=300)
    assert result.state == "FINISHED", result.cause
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.ping.remote(), timeout=30)


def test_a_coordinator_ray_is_restarting_counts_as_live(monkeypatch):
    """Its status call meets `ActorUnavailableError` (Ray restarts it): not a positive end."""
    def unavailable(*_a, **_k):
        raise ray.exceptions.ActorUnavailableError("restarting", b"\0" * 16)
    monkeypatch.setattr(coordinator_handle.ray, "get", unavailable)

    class Handle:
        class status:  # an actor method's shape
            @staticmethod
            def remote():
                return None
    prior = prior_job(Handle())  # type: ignore[arg-type]
    assert prior.verdict is Prior.LIVE and "restarted" in prior.state


def test_the_cli_refuses_in_one_line_with_exit_2(run_root, tmp_path):
    import yaml

    name = "dup-cli"
    old = stand_in(name, "RUNNING")
    try:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(config(name)))
        address = ray.get_runtime_context().gcs_address
        done = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(path), "--address", address], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        print(done.stderr)
        assert done.returncode == 2 and lines[-1].startswith("error: a job named 'dup-cli' is RUNNING at step 42"), done
        assert ray.get(old.ping.remote(), timeout=30) == "alive"
    finally:
        ray.kill(old, no_restart=True)
