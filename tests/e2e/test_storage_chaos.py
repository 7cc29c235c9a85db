"""The storage chaos run (slow: `pytest --run-slow tests/e2e/test_storage_chaos.py`), on S3 (a moto server
on 127.0.0.1): every checkpoint upload fails for the job's first 30 s (`faults.checkpoint_fail_s`); then
the coordinator is SIGKILLed and its node's run folder deleted, so Ray's restart carries on from the
store, while a zombie of the dead incarnation (its run folder's copy, mirrored by the same code) is kept
alive writing an older state file, a FAILED status and events to the same run. The run must end with
history holding every step once (here and on the store), the store's status the live run's, the zombie
fenced off, every failed upload named by an event, and the newest valid checkpoint resumable."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

from actors.runs import checkpoints, runfiles
from actors.runs.mirror import RunMirror, read_appended
from actors.runs.storage import open_storage
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import wait_until

FAIL_S = 30.0


class Zombie:
    """The dead incarnation as a partition leaves it: its folder and its mirror, still writing."""

    def __init__(self, storage, key: str, folder, incarnation: int):
        self.folder = folder
        self.mirror = RunMirror(storage, key, folder, incarnation, interval_s=0.2).start()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            with open(self.folder / "events.jsonl", "a") as out:
                out.write(json.dumps({"time": time.time(), "kind": "info", "reason": f"zombie write {n}",
                                      "state_from": None, "state_to": None, "detail": {}}) + "\n")
            runfiles.write_json_atomic(self.folder / "status.json", {"state": "FAILED", "cause": "zombie"})
            self.mirror.put("status.json")
            self.mirror.put("coordinator.json")
            self.mirror.flush(2)
            self.stop.wait(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.mirror.close(5)


@pytest.mark.slow  # 30 s of failing uploads, a coordinator restart and a resume: about 2 minutes
def test_failing_uploads_then_a_coordinator_restart_beside_a_zombie_lose_nothing(run_root, s3, tmp_path):
    uri = s3.format(prefix="chaos")
    cfg = {"name": "storage-chaos", "seed": 3, "storage": uri,
           "workers": {"count": 3, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "checkpoint": {"every_steps": 25, "keep": 3}, "eval_every": 0,
           "stop": {"max_steps": 1_000_000},
           "faults": {"checkpoint_fail_s": FAIL_S, "stragglers": [{"slot": "w0", "delay_s": 0.05}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    storage = open_storage(uri)
    key = f"{job.name}/{job.run_id}"
    events = lambda: job.events()  # noqa: E731
    wait_until(lambda: any(e["kind"] == "checkpoint" for e in events()), timeout=FAIL_S + 90,
               what="a checkpoint stored once the failures end")
    failed = [e for e in events() if e["kind"] == "checkpoint_failed"]
    first_stored = next(e for e in events() if e["kind"] == "checkpoint")
    assert failed and all(e["detail"].get("error") for e in failed), failed
    assert first_stored["time"] >= job.status().started_at + FAIL_S - 1, "a checkpoint was stored while uploads failed"

    before = job.status()
    copy = tmp_path / "zombie"
    shutil.copytree(job.run_dir, copy)
    os.kill(before.coordinator_pid, signal.SIGKILL)
    shutil.rmtree(job.run_dir)  # the node's folder goes with it: the restart reads the store
    zombie = Zombie(storage, key, copy, before.incarnation)
    try:
        after = wait_until(lambda: (s := job.status()).incarnation > before.incarnation and s.state == "RUNNING" and s,
                           timeout=120, what="the restarted coordinator")
        wait_until(lambda: zombie.mirror.fenced, timeout=60, what="the zombie fenced off")
        wait_until(lambda: job.status().step > after.step + 30, timeout=120, what="training after the restart")
    finally:
        zombie.close()
    result = job.stop()
    steps = result.step
    assert result.state == "STOPPED", result
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, steps + 1)), "history has a gap or a repeat"
    stored = runfiles.parse_jsonl(read_appended(storage, f"{key}/history.jsonl"))
    assert [r["step"] for r in stored] == list(range(1, steps + 1)), "the store's history has a gap or a repeat"
    assert json.loads(storage.read(f"{key}/status.json"))["state"] == "STOPPED", "the zombie's status won"
    stored_events = runfiles.parse_jsonl(read_appended(storage, f"{key}/events.jsonl"))
    restart = next(e for e in stored_events if e["kind"] == "restart")
    zombie_after = [e for e in stored_events if e["reason"].startswith("zombie") and e["time"] > restart["time"] + 5]
    assert not zombie_after, f"{len(zombie_after)} zombie events read back after the restart"
    named = {(e["detail"]["step"], e["detail"]["attempt"]) for e in stored_events if e["kind"] == "checkpoint_failed"}
    assert {(e["detail"]["step"], e["detail"]["attempt"]) for e in failed} <= named, "a failed upload has no event"

    ref = checkpoints.newest_valid_of_job((storage, job.name), server=False, warn=print)
    assert ref is not None and ref.run_id == job.run_id and ref.step <= steps, ref
    resumed = ElasticJob(config_from_dict(dict(cfg, faults={}, stop={"max_steps": ref.step + 10})),
                         resume_from=ref.location).start().wait(timeout=180)
    print(f"{len(failed)} failed uploads over {FAIL_S:g}s; first checkpoint stored at step "
          f"{first_stored['detail']['step']}; coordinator restarted as incarnation {after.incarnation} from the store "
          f"beside a zombie (fenced); stopped at {steps}, history 1..{steps} once; resumed from step {ref.step} "
          f"to {resumed.step}: {resumed.state}")
    assert resumed.state == "FINISHED" and resumed.step == ref.step + 10, resumed
