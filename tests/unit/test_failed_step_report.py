"""After a failed step a member reports its committed steps without waiting for the coordinator's
answer: the coordinator is busy with the failure then (deciding, publishing the survivors' plan), and
that plan is what the member waits for next. Reports keep their order whatever their waiting.
Real replicas in threads (testkit's `LocalJob`) whose coordinator answers no waited report until the
survivors have committed a step of the next membership epoch: with the old waited report they never do."""
from __future__ import annotations

import threading

from actors.plan import Progress
from orchestrator.config import load_config
from testkit.harness import LocalJob, wait_until

CONFIG = "configs/digits_bytegrad.yaml"
"""Its buckets go out as the communicator's own operations, which an abort releases. Not torch's reducer:
there an abort shuts down the group's connections by address, and with both members in one process a
member's abort would also shut its neighbour's (actors/transport/gloo.py)."""


class BusyLink:
    """Records every report at once, as the coordinator's sequencer does, and holds a waited one's
    answer until `free` (a coordinator busy elsewhere)."""

    def __init__(self, link) -> None:
        self.link, self.free, self.waited = link, threading.Event(), []

    def report(self, progress: Progress, wait: bool) -> None:
        self.link.report(progress, wait)
        if wait:
            self.waited.append(progress.membership_epoch)
            self.free.wait(120)

    def __getattr__(self, name: str):
        return getattr(self.link, name)


def test_a_member_whose_step_failed_takes_the_next_plan_without_waiting_for_its_report(tmp_path):
    config = load_config(CONFIG, ["workers.count=2", "workers.min=1", "stop.max_steps=400", "stop.target=null",
                                  "eval_every=0"]).to_dict()
    job = LocalJob(config, ["w0", "w1"], str(tmp_path), wrap_link=BusyLink)
    busy = job.replicas["w0"].link
    batch = 2 * config["workload"]["batch_size"]
    job.publish(("w0", "w1"), 1, batch)
    job.start()
    try:
        wait_until(lambda: any(r["step"] >= 5 for r in job.link.records), 60, "steps of epoch 1")
        for replica in job.replicas.values():
            replica.abort_epoch(1, "a member died (the test)")
        # the next epoch ends the run 30 steps on, both members at the same step (a plan's stop)
        job.publish(("w0", "w1"), 2, batch, stop_step=max(r.training.step for r in job.replicas.values()) + 30)
        wait_until(lambda: any(r["membership_epoch"] == 2 for r in job.link.records), 60,
                   "a committed step of epoch 2 while the coordinator answers no waited report")
        assert 1 not in busy.waited, "no report of the failed epoch waited for an answer"
    finally:
        busy.free.set()
    outcomes = job.wait(120)
    assert all(o.ok for o in outcomes.values()), outcomes
    steps = [r["step"] for r in job.link.records]
    assert steps == sorted(steps), "history in order"
