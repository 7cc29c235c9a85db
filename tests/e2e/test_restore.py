"""Every member lost at once (a rack's power): with a checkpoint, the job starts fresh members from
the newest valid one and carries on, costing the steps since it; without one it fails (resumable)."""
from __future__ import annotations

import io

import pytest
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob

CONFIG = {
    "name": "restore", "seed": 5, "workers": {"count": 3, "min": 3, "cpus": 0.5},  # full width from step 1 (test_storage.py)
    "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 16},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "checkpoint": {"every_steps": 20},
    "stop": {"max_steps": 100}, "eval_every": 0,
}


def final_params(job: ElasticJob) -> list[torch.Tensor]:
    return list(torch.load(io.BytesIO((job.run_dir / "model.pt").read_bytes()), weights_only=True)["model"].values())


def test_every_member_killed_at_once_restarts_from_the_newest_checkpoint_and_matches_an_uninterrupted_run(run_root):
    kills = [{"slot": f"w{i}", "step": 65, "how": "sigkill"} for i in range(3)]
    job = ElasticJob(config_from_dict({**CONFIG, "faults": {"kills": kills}})).start()
    plain = ElasticJob(config_from_dict({**CONFIG, "name": "restore-plain"})).start()  # the reference, meanwhile
    result = job.wait(timeout=180)
    restores = [e for e in job.events() if e["kind"] == "restore"]
    print(f"{result.state} at {result.step}; {[e['reason'] for e in restores]}")
    assert result.state == "FINISHED" and result.step == 100, result
    assert len(restores) == 1 and restores[0]["detail"]["step"] == 60, restores
    steps = [r["step"] for r in job.history()]
    lost = restores[0]["detail"]["redone"]
    assert steps[-40:] == list(range(61, 101)) and steps[:60] == list(range(1, 61)), steps
    assert steps[60:-40] == list(range(61, 61 + len(steps) - 100)), steps  # what the lost members reported after it
    assert lost == ([61, 60 + len(steps) - 100] if len(steps) > 100 else []), lost

    assert plain.wait(timeout=120).state == "FINISHED"
    diff = max(float((a - b).abs().max()) for a, b in zip(final_params(job), final_params(plain)))
    print(f"restored run vs uninterrupted: max abs diff {diff:.2e}")
    assert diff == 0.0


@pytest.mark.slow  # in process: tests/unit/test_admission.py, test_journal.py; all killed through Ray: the test above
def test_every_member_killed_while_the_first_checkpoint_is_being_stored_restarts_from_it(run_root):
    """Storing a checkpoint takes 1 s here (`faults.checkpoint_store_s`, an upload to a slow store); all
    three members are killed at step 25, five steps after the first checkpoint was taken, while it is
    still being stored. The job does not fail for want of a checkpoint: it waits for that store and
    restarts from step 20."""
    kills = [{"slot": f"w{i}", "step": 25, "how": "sigkill"} for i in range(3)]
    cfg = {**CONFIG, "name": "restore-storing", "stop": {"max_steps": 40},
           "faults": {"kills": kills, "checkpoint_store_s": 1.0}}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=180)
    restores = [e for e in job.events() if e["kind"] == "restore"]
    print(f"{result.state} at {result.step}; {[e['reason'] for e in restores]}")
    assert result.state == "FINISHED" and result.step == 40, (result, restores)
    assert len(restores) == 1 and restores[0]["detail"]["step"] == 20, restores


def test_a_finished_job_s_last_checkpoint_is_stored_before_it_reports_finished(run_root):
    """The checkpoint taken at the last step goes to the coordinator, which stores it off its event loop
    (an upload) while the members finish: the job reports FINISHED only once it is stored. Storing takes
    1.5 s here (faults.checkpoint_store_s); without the wait, the job ended and its coordinator exited
    first, and the step-40 checkpoint was missing (as on S3 in CI: its data without its manifest)."""
    from actors.runs import checkpoints

    cfg = dict(CONFIG, name="last-checkpoint", workers={"count": 2, "cpus": 0.5}, stop={"max_steps": 40},
               faults={"checkpoint_store_s": 1.5})
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=120)
    assert result.state == "FINISHED" and result.step == 40, result
    newest = checkpoints.newest_valid(job.run_dir.parent, warn=lambda line: None)
    assert newest is not None and newest.step == 40, f"the newest stored checkpoint: {newest}"
    assert checkpoints.verify(str(job.run_dir / "checkpoints" / "step-00000040.json")) is None
