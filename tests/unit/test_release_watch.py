"""A step that outlives its group's abort ends the worker (`actors.training.replica.watch_release`): gloo's ring
all-reduce inside torch's reducer has been seen to keep waiting for a SIGKILLed peer after the abort shut
its pairs down, for the group's whole timeout, holding every member's next membership meanwhile."""
from __future__ import annotations

import threading

import pytest

from actors.training import replica as replica_module
from actors.training.replica import watch_release
from testkit.harness import LocalJob


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_wait_never_released_is_declared_stuck_once_the_grace_has_passed():
    clock, stuck = FakeClock(), []
    watch_release(lambda: False, 10.0, lambda: stuck.append(clock.now), clock=clock, sleep=clock.sleep).join(5)
    assert len(stuck) == 1 and 10.0 <= stuck[0] < 10.1, stuck


def test_a_wait_released_within_the_grace_is_left_alone():
    clock, stuck = FakeClock(), []
    watch_release(lambda: clock.now >= 9.0, 10.0, lambda: stuck.append(clock.now), clock=clock, sleep=clock.sleep).join(5)
    assert stuck == []


class AbortOnly:
    """A group whose abort releases nothing by itself (the replica's step stands for the stuck wait)."""

    name = "test/e1"

    def __init__(self) -> None:
        self.aborted = False

    def abort(self, reason: str) -> None:
        self.aborted = True


@pytest.mark.parametrize("left_the_step", [False, True], ids=["stuck", "released"])
def test_an_abort_during_a_step_ends_the_worker_only_when_the_step_never_leaves(tmp_path, monkeypatch, left_the_step):
    """The replica's own abort path (`abort_epoch`): a run thread still inside its step (phase `compute`)
    when the grace ends is stuck; one that went on to wait for the next plan is not."""
    monkeypatch.setattr(replica_module, "STUCK_AFTER_ABORT_S", 0.3)
    cfg = {"name": "stuck", "seed": 1, "workers": {"count": 1, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 4},
           "optimizer": {"name": "sgd", "lr": 0.1}, "stop": {"max_steps": 1}, "eval_every": 0}
    said, done = [], threading.Event()
    job = LocalJob(cfg, ["w0"], str(tmp_path), exit_if_stuck=lambda why: (said.append(why), done.set()))
    replica = job.replicas["w0"]
    replica.plan = job.publish(("w0",), 1, 4)
    replica.group.comm = AbortOnly()
    replica.enter_phase("compute")
    replica.abort_epoch(1, "w1 died")
    assert replica.group.comm.aborted
    if left_the_step:
        replica.enter_phase("waiting")  # the abort released its wait: it waits for the next plan
    done.wait(3.0)
    if left_the_step:
        assert said == []
    else:
        assert len(said) == 1 and "still runs" in said[0] and "w1 died" in said[0], said
