"""Local runs reachable by name (orchestrator/local_runs.py): the per-user record of a local Ray's address,
its safety (a folder of the user's alone, files 0600, never a link followed, no credential), and stale
records; `ElasticJob.attach` of an ended job from its run folder without any Ray. No Ray here."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.schema import JobStatus
from orchestrator import local_runs
from orchestrator.local_runs import LocalRun


@pytest.fixture
def records(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "records"
    monkeypatch.setenv("ORCHESTRATOR_LOCAL_RUNS", str(folder))
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path / "runs"))
    return folder


def _mine(name: str = "job", run_dir: str = "/runs/job/1") -> LocalRun:
    pid = os.getpid()
    return LocalRun(name=name, run_dir=run_dir, address="10.0.0.1:6379", pid=pid,
                    pid_started=local_runs.process_start(pid), started_at=time.time())


def _gone_pid() -> tuple[int, str]:
    """The pid of a process that has ended (and its start time, as it was)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    started = local_runs.process_start(child.pid)
    child.communicate(b"")
    return child.pid, started


def test_a_live_run_is_found_by_name_in_a_private_file(records):
    run = _mine()
    local_runs.record(run)
    found = local_runs.lookup("job")
    assert found == run and found.live
    assert stat.S_IMODE(records.stat().st_mode) == 0o700
    path = records / "job.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert set(json.loads(path.read_text())) == {"name", "run_dir", "address", "pid", "pid_started", "started_at"}
    assert [p.name for p in records.iterdir()] == ["job.json"]  # no temp file left behind


def test_a_record_whose_process_ended_loses_its_address_and_keeps_its_run_folder(records):
    pid, started = _gone_pid()
    local_runs.record(LocalRun(name="job", run_dir="/runs/job/1", address="10.0.0.1:6379", pid=pid, pid_started=started))
    found = local_runs.lookup("job")
    assert found is not None and found.address is None and found.run_dir == "/runs/job/1"
    assert json.loads((records / "job.json").read_text())["address"] is None  # the stale address is gone for good


def test_a_reused_pid_is_not_taken_for_the_process_that_started_the_ray(records):
    local_runs.record(LocalRun(name="job", run_dir="/r", address="10.0.0.1:6379", pid=os.getpid(), pid_started="1"))
    found = local_runs.lookup("job")
    assert found is not None and found.address is None


def test_ended_drops_only_its_own_processes_address(records):
    local_runs.record(_mine())
    local_runs.ended("job", os.getpid() + 1)  # another process's end: not this record's
    assert local_runs.lookup("job").address == "10.0.0.1:6379"
    local_runs.ended("job", os.getpid())
    assert local_runs.lookup("job").address is None


def test_a_record_that_is_a_link_is_not_followed(records, tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"run_dir": "/x", "address": "10.9.9.9:1", "pid": os.getpid(),
                                     "pid_started": local_runs.process_start(os.getpid())}))
    records.mkdir(mode=0o700)
    (records / "job.json").symlink_to(elsewhere)
    assert local_runs.lookup("job") is None
    local_runs.record(_mine())  # a new record replaces the link itself, and writes nothing through it
    assert not (records / "job.json").is_symlink()
    assert json.loads(elsewhere.read_text())["address"] == "10.9.9.9:1"


@pytest.mark.parametrize("unsafe", ["open to others", "a link"])
def test_a_records_folder_that_is_not_the_users_alone_is_refused(records, tmp_path, unsafe, caplog):
    if unsafe == "a link":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        records.symlink_to(real)
    else:
        records.mkdir()
        records.chmod(0o755)
    local_runs.record(_mine())
    assert "could not record job job's local Ray" in caplog.text
    assert not list((tmp_path / "real" if unsafe == "a link" else records).iterdir())
    assert local_runs.lookup("job") is None


@pytest.mark.parametrize("name", ["../job", "a/b", ".hidden", ""])
def test_a_name_that_is_not_a_plain_file_name_has_no_record(records, name):
    local_runs.record(_mine(name=name))
    assert local_runs.lookup(name) is None
    assert not records.exists() or not list(records.iterdir())


def test_the_run_folder_of_a_name_is_the_newest_of_the_recorded_one_and_the_run_roots(records, tmp_path):
    runs = tmp_path / "runs" / "job"
    for run_id in ("20260101-000000-aaaa", "20260102-000000-bbbb"):
        (runs / run_id).mkdir(parents=True)
        (runs / run_id / "config.yaml").write_text("name: job\n")
    assert local_runs.run_folder("job") == runs / "20260102-000000-bbbb"
    custom = tmp_path / "custom" / "job" / "20260103-000000-cccc"  # a config's own run_dir
    custom.mkdir(parents=True)
    local_runs.record(_mine(run_dir=str(custom)))
    assert local_runs.run_folder("job") == custom
    assert local_runs.run_folder("other") is None


def test_status_of_an_ended_local_job_reads_its_status_json_with_no_ray(records, tmp_path, monkeypatch):
    import ray

    from orchestrator.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    run_dir = tmp_path / "runs" / "finished" / "20260101-000000-aaaa"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: finished\nworkload:\n  factory: orchestrator.workloads.digits:make\n")
    status = JobStatus(name="finished", run_id=run_dir.name, state="FINISHED", step=42, membership_epoch=1, world_size=2,
                       members=(), loss=0.5, throughput=None, cause=None, run_dir=str(run_dir))
    (run_dir / "status.json").write_text(json.dumps(status.to_dict(), default=str))
    pid, started = _gone_pid()  # its run's process, and its local Ray, are gone
    local_runs.record(LocalRun(name="finished", run_dir=str(run_dir), address="10.0.0.1:1", pid=pid, pid_started=started))
    assert main(["status", "finished"]) == 0
    assert main(["stop", "finished"]) == 0  # nothing left to stop: its final state
    assert not ray.is_initialized()


def test_status_of_a_job_that_is_nowhere_names_where_it_looked(records, capsys, monkeypatch):
    from orchestrator.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["status", "nowhere"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no job named 'nowhere'" in err and "--address" in err



def test_report_of_a_job_name_draws_its_newest_run(records, tmp_path, monkeypatch, capsys):
    from actors.observe import report
    from orchestrator.cli import main

    pytest.importorskip("matplotlib", reason="the report needs matplotlib (the plot extra)")
    drawn: list[Path] = []
    monkeypatch.setattr(report, "draw", lambda run_dir, out: drawn.append(run_dir) or run_dir / "report.png")
    run_dir = tmp_path / "runs" / "job" / "20260101-000000-aaaa"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: job\n")
    assert main(["report", "job"]) == 0 and drawn == [run_dir]
    assert main(["report", "other"]) == 2
    assert "nor the name of a job with a run folder here" in capsys.readouterr().err
