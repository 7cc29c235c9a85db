"""A mistake in the workload's own code fails once, fast, naming the user's file and line (no Ray).

The rule (`workload_bug` and `decide`): a value the workload contract refuses ends the job at once; an
exception ends it once the same one (call, type, the user's file and line) came from a second member, or
from a slot's next worker at the same step; a first exception is a worker failure as before. The worker's
side (actors/training/user_code.py) names the innermost frame of the user's code. The coordinator's
paths run the real `Coordinator` over the fake worker group. The config's side: `workload.params`
against the factory's signature, and a stop target no evaluation returns. The same mistakes through Ray
and the CLI: tests/e2e/test_workload_mistakes.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.messages import RunOutcome
from actors.plan import Progress
from actors.training import user_code
from actors.training.user_code import WorkloadBug
from algorithms.rules.supervision import JobState, JobView, MemberEnded, MemberState, WorkloadFault, decide, workload_bug
from core.schema import ConfigError
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup
from testkit.job_checks import until
from tests.unit.test_coordinator_paths import config, coordinator, ended, events, run, started

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
BUGGY = WORKLOADS / "buggy_workload.py"
T = MemberState.TRAINING


def mistake_line(name: str) -> str:
    """`file:line` of the line of buggy_workload.py marked `# mistake: <name>`."""
    lines = BUGGY.read_text().splitlines()
    (number,) = [i + 1 for i, line in enumerate(lines) if line.endswith(f"# mistake: {name}")]
    return f"{BUGGY}:{number}"


@pytest.fixture
def buggy(monkeypatch):
    monkeypatch.syspath_prepend(str(WORKLOADS))
    import buggy_workload
    return buggy_workload


def fault(where: str = "/home/u/model.py:41", step: int | None = 7, kind: str = "loss", type_: str = "RuntimeError",
          message: str = "mat1 and mat2 shapes cannot be multiplied (32x64 and 32x512)") -> WorkloadFault:
    return WorkloadFault(kind, type_, message, where, "Traceback (most recent call last): ...", step)


def ended_on(slot: str, f: WorkloadFault) -> MemberEnded:
    return MemberEnded(slot, "error", f"worker {slot} raised an exception: {f.line}", "workload", workload_fault=f)


def view(plan=("w0", "w1", "w2"), members=None, earlier=(), **over) -> JobView:
    return JobView(state=JobState.RUNNING, plan_members=plan, members=members or {s: T for s in plan},
                   workload_faults=tuple(earlier), **over)


# ------------------------------------------------------------------ the rule
def test_a_first_exception_is_a_worker_failure_the_same_from_a_second_member_ends_the_job():
    first = decide(view(), ended_on("w0", fault()))
    assert first.replace and first.count_failure and first.publish == ("w1", "w2") and first.stop_kind is None
    second = decide(view(members={"w0": MemberState.FAILED, "w1": T, "w2": T}, earlier=[("w0", fault())]),
                    ended_on("w1", fault()))
    assert second.stop_kind == "FAILED" and second.stop_step == "held" and second.publish == ("w2",)
    assert not (second.replace or second.count_failure or second.retire)
    assert second.reason.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x64 and 32x512) "
                                    "(workload.loss at /home/u/model.py:41, step 7); the same in w0 and w1: a bug in "
                                    "the workload [traceback: workers/w1.log]"), second.reason


def test_a_bug_with_no_holder_left_ends_the_job_at_once_without_resume_advice():
    members = {"w0": MemberState.FAILED, "w1": T}
    d = decide(view(plan=("w0", "w1"), members=members, earlier=[("w0", fault())]), ended_on("w1", fault()))
    assert d.end_now == JobState.FAILED and "a bug in the workload" in d.reason and "--resume" not in d.reason
    # a first exception of the only worker: it may be the worker's own trouble, but a resume is not advised
    alone = decide(view(plan=("w0",)), ended_on("w0", fault()))
    assert alone.end_now == JobState.FAILED and "--resume" not in alone.reason
    assert "/home/u/model.py:41" in alone.reason


def test_a_replacement_failing_at_the_same_step_is_a_bug_at_another_step_a_failure_again():
    earlier = [("w1", fault(step=7))]
    assert "the same again in w1's next worker at step 7" in workload_bug(fault(step=7), "w1", earlier)
    assert workload_bug(fault(step=9), "w1", earlier) is None
    start = [("w0", fault(kind="factory", step=None))]
    assert "at its start" in workload_bug(fault(kind="factory", step=None), "w0", start)


def test_another_line_type_or_call_is_another_failure():
    earlier = [("w0", fault())]
    assert workload_bug(fault(where="/home/u/model.py:42"), "w1", earlier) is None
    assert workload_bug(fault(type_="ValueError"), "w1", earlier) is None
    assert workload_bug(fault(kind="evaluate"), "w1", earlier) is None
    assert workload_bug(fault(message="another message, the same line"), "w1", earlier) is not None


def test_a_value_the_contract_refuses_ends_the_job_at_its_first_occurrence():
    refused = fault(type_="", message="workload.loss returned a tensor of shape (32,), not a scalar: reduce it "
                                      "(e.g. .mean())")
    d = decide(view(), ended_on("w2", refused))
    assert d.stop_kind == "FAILED" and not d.replace and not d.count_failure
    assert d.reason == ("workload.loss returned a tensor of shape (32,), not a scalar: reduce it (e.g. .mean()) "
                        "(/home/u/model.py:41, step 7)")


# ------------------------------------------------------------------ the worker's side
def test_each_mistake_names_the_users_file_and_line(buggy):
    with pytest.raises(WorkloadBug) as raised:
        user_code.call("factory", buggy.raising_factory, hidden=4)
    assert raised.value.fault.where == mistake_line("factory") and raised.value.fault.type == "FileNotFoundError"
    assert raised.value.fault.step is None and "Traceback" in raised.value.fault.traceback

    w = buggy.failing_forward()
    batch = w.train_data[:8]
    with pytest.raises(WorkloadBug) as raised:
        user_code.call("loss", w.loss, w.model, batch, step=3)
    f = raised.value.fault
    assert (f.kind, f.type, f.where, f.step) == ("loss", "RuntimeError", mistake_line("forward"), 3)
    assert f.line.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), f.line

    w = buggy.vector_loss()
    with pytest.raises(WorkloadBug) as raised, user_code.contract("loss", w.loss, 1):
        user_code.require_scalar(w.loss(w.model, batch))
    assert raised.value.fault.certain and raised.value.fault.where == mistake_line("vector_loss")
    assert raised.value.fault.message == "workload.loss returned a tensor of shape (8,), not a scalar: reduce it (e.g. .mean())"

    w = buggy.string_metric()
    with pytest.raises(WorkloadBug) as raised:
        user_code.metrics_of(w.evaluate, w.model, w.eval_data, 5)
    assert raised.value.fault.certain and raised.value.fault.where == mistake_line("string_metric")
    assert raised.value.fault.message == "evaluate returned metric 'quality' = 'high' (str): metrics must be numbers"

    from actors.control.members import _raised_line

    def hooked(model, batch):  # the user's code calls into this project's, which raises (a policy's hook)
        return _raised_line(None)

    with pytest.raises(AttributeError):  # an exception of this project's code leaves as it came: not the workload's
        user_code.call("loss", hooked, None, None, step=1)


def test_metrics_are_numbers_and_one_element_tensors_never_strings():
    got = user_code.metrics_of(lambda m, d: {"a": 1, "b": torch.tensor([0.5]), "c": torch.tensor(2.0).double()}, None,
                               None, 1)
    assert got == {"a": 1.0, "b": 0.5, "c": 2.0}
    for bad in ("0.5", torch.ones(3), None):
        with pytest.raises(WorkloadBug):
            user_code.metrics_of(lambda m, d, bad=bad: {"x": bad}, None, None, 1)


# ------------------------------------------------------------------ the coordinator's paths
class TaskError(RuntimeError):
    """What Ray raises in the caller of an actor method that raised: the actor's exception as `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_a_factory_that_raises_in_every_worker_fails_the_job_with_its_line_without_retries(tmp_path, monkeypatch):
    bug = fault(kind="factory", step=None, type_="FileNotFoundError",
                message="[Errno 2] No such file or directory: '/data/fmnist/train.pt'")

    async def scenario():
        group = FakeWorkerGroup()

        async def ready(handle, fired_faults):
            raise TaskError(WorkloadBug(bug))
        monkeypatch.setattr(group, "ready", ready)
        coord = coordinator(config("factory-bug", workers={"count": 2, "failure_budget": 3}), tmp_path, group)
        began = time.monotonic()
        await coord.start()
        assert await ended(coord) == JobState.FAILED
        took = time.monotonic() - began
        assert coord.job.cause.startswith("no worker could start: FileNotFoundError: [Errno 2] No such file or directory: "
                                      "'/data/fmnist/train.pt' (workload.factory at /home/u/model.py:41); the same in "
                                      "w0 and w1: a bug in the workload"), coord.job.cause
        (failure,) = [e for e in events(coord, "failure") if e.detail.get("detector") == "workload"]
        assert failure.detail["traceback"] == bug.traceback
        assert not events(coord, "retired") and len(group.workers) == 2, "started once each, never retried"
        assert took < 5, took  # the retries' pauses (RESTART_AFTER_S each, to the failure budget) never came
    run(scenario())


def test_a_forward_failing_in_two_members_fails_the_job_with_its_line_and_traceback(tmp_path):
    bug = fault(step=3)

    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("forward-bug"), tmp_path, group)
        await group.commit(coord, 2)
        for slot in ("w0", "w1"):
            group.current(slot).end("error", RunOutcome(False, error=bug.line, traceback=bug.traceback, workload_fault=bug))
        await until(lambda: coord.job.stop_kind == "FAILED" or coord.job.state.terminal, "the stop")
        await group.commit(coord, 1)  # w2, the survivor, stops at the step it holds
        assert await ended(coord) == JobState.FAILED
        assert bug.line in coord.job.cause and "the same in w0 and w1: a bug in the workload" in coord.job.cause
        assert "--resume" not in coord.job.cause
        failures = events(coord, "failure")
        assert failures[-1].detail["traceback"] == bug.traceback and failures[-1].detail["detector"] == "workload"
        assert not events(coord, "retired")
    run(scenario())


async def evaluated_at_step_3(coord, group: FakeWorkerGroup) -> None:
    """Every member at step 3, whose record (rank 0's report) carries an evaluation: accuracy 0.5, eval_loss 1.2."""
    plan = coord.book.plan
    record = {"step": 3, "time": time.time(), "loss": 0.3, "world_size": len(plan.members),
              "global_batch": plan.global_batch, "micro_steps": 1, "membership_epoch": plan.membership_epoch,
              "bytes_sent": 3000, "metrics": {"accuracy": 0.5, "eval_loss": 1.2}}
    for slot in plan.members:
        group.current(slot).step = 3
    await coord.report(Progress(plan.members[0], 3, plan.membership_epoch, time.time(), (record,), 0.01, mark=3))


def ended_by_the_target(tmp_path, name: str, target: dict, kind: str) -> tuple[JobState, Any]:
    """A job with `target` whose members commit two steps, then report an evaluation at step 3: once its
    coordinator decides a stop of `kind`, the members commit one more step; its end and the coordinator."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config(name, stop={"max_steps": 1000, "target": target}), tmp_path, group)
        await group.commit(coord, 2)
        await evaluated_at_step_3(coord, group)
        await until(lambda: coord.job.stop_kind == kind, "the stop")
        await group.commit(coord, 1)
        return await ended(coord), coord
    return run(scenario())


def test_a_stop_target_no_evaluation_returns_fails_the_job_at_the_first_evaluation(tmp_path):
    state, coord = ended_by_the_target(tmp_path, "target-typo", {"metric": "acuracy", "value": 0.9}, "FAILED")
    assert state == JobState.FAILED
    assert coord.job.cause == ("stop.target.metric 'acuracy' is not among the metrics evaluate returned "
                               "(accuracy, eval_loss); did you mean 'accuracy'?")


def test_an_evaluation_that_meets_the_stop_target_finishes_the_job_saying_so(tmp_path):
    """The stop at a target through the real coordinator (the README's job stops at its 0.97 this way)."""
    state, coord = ended_by_the_target(tmp_path, "target-met", {"metric": "accuracy", "value": 0.4}, "FINISHED")
    assert state == JobState.FINISHED
    said = [e.reason for e in coord.journal.events]
    assert any(r.startswith("target reached: accuracy = 0.5000 (max 0.4)") for r in said), said


# ------------------------------------------------------------------ the config's side
def digits(params: dict, factory: str = "orchestrator.workloads.digits:mlp") -> dict:
    return {"name": "x", "workload": {"factory": factory, "params": params}, "stop": {"max_steps": 3}}


def test_a_params_typo_is_named_at_validation_with_the_nearest_name_and_every_shipped_config_passes(monkeypatch):
    with pytest.raises(ConfigError) as raised:
        config_from_dict(digits({"hiden": 32}))
    assert str(raised.value) == ("workload.params.hiden: the factory orchestrator.workloads.digits:mlp takes no "
                                 "parameter 'hiden'; did you mean 'hidden'?")
    with pytest.raises(ConfigError, match=r"workload.params.zzz: .* takes no parameter 'zzz'; it takes hidden, depth, dtype"):
        config_from_dict(digits({"zzz": 1}))
    config_from_dict(digits({"hidden": 32, "depth": 1}))
    from orchestrator.config import load_config

    for path in sorted((WORKLOADS.parents[1] / "configs").glob("*.yaml")):
        load_config(path)
    monkeypatch.chdir(WORKLOADS)
    load_config(WORKLOADS / "custom.yaml")


def test_a_factory_taking_kwargs_accepts_any_name_and_a_missing_required_one_is_named(tmp_path, monkeypatch):
    (tmp_path / "kw_workload.py").write_text("def loose(**anything):\n    pass\n\n"
                                             "def strict(width, *, depth=2):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kw_workload", None)
    config_from_dict(digits({"whatever": 1, "hiden": 2}, "kw_workload:loose"))
    config_from_dict(digits({"width": 3}, "kw_workload:strict"))
    with pytest.raises(ConfigError, match=r"^workload.params.width: missing; the factory kw_workload:strict needs it"):
        config_from_dict(digits({"depth": 3}, "kw_workload:strict"))


def test_the_stop_targets_metric_is_checked_against_what_evaluate_returned():
    target = config_from_dict(digits({}) | {"stop": {"target": {"metric": "acuracy", "value": 0.9}}}).stop.target
    assert target is not None
    assert target.unknown_in({"accuracy": 0.5}) == ("stop.target.metric 'acuracy' is not among the metrics evaluate "
                                                    "returned (accuracy); did you mean 'accuracy'?")
    assert target.unknown_in({"loss": 0.5}) == "stop.target.metric 'acuracy' is not among the metrics evaluate returned (loss)"
    assert target.unknown_in({"acuracy": 0.5}) is None

