"""A plan that aborts the epoch it ends (`Plan.aborts_epoch`): the survivors' plan after a death is one
call to each member, not an abort and then a plan, and its receipt fails the old epoch's collectives
at once, before the plan is taken. Real replicas in threads (testkit's `LocalJob`).

Without the abort on receipt the members would go on training under epoch 1 and switch to epoch 2 at a
step boundary with no failure (the vote's newer-plan flag), as a join does: the step under way when the
plan arrives would not fail."""
from __future__ import annotations

from orchestrator.config import load_config
from testkit.harness import LocalJob, wait_until

CONFIG = "configs/digits_bytegrad.yaml"
"""Its buckets go out as the communicator's own operations, which an abort releases (tests/unit/
test_failed_step_report.py says why not torch's reducer with two members in one process)."""


def test_a_plan_that_aborts_its_epoch_fails_the_step_under_way_and_the_members_go_on_under_it(tmp_path):
    config = load_config(CONFIG, ["workers.count=2", "workers.min=1", "stop.max_steps=400", "stop.target=null",
                                  "eval_every=0"]).to_dict()
    job = LocalJob(config, ["w0", "w1"], str(tmp_path))
    batch = 2 * config["workload"]["batch_size"]
    job.publish(("w0", "w1"), 1, batch)
    job.start()
    wait_until(lambda: any(r["step"] >= 5 for r in job.link.records), 60, "steps of epoch 1")
    reason = "worker w2's process is exiting (the test)"
    stop = max(r.training.step for r in job.replicas.values()) + 20
    job.publish(("w0", "w1"), 2, batch, stop_step=stop, aborts_epoch=1, reason=reason)
    wait_until(lambda: any(r["membership_epoch"] == 2 for r in job.link.records), 60, "a committed step of epoch 2")
    for slot, replica in job.replicas.items():
        assert "membership epoch aborted" in replica.cause and reason in replica.cause, \
            f"{slot}: the plan's receipt failed its epoch-1 step ({replica.cause!r})"
    outcomes = job.wait(120)
    assert all(o.ok for o in outcomes.values()), outcomes
    steps = [r["step"] for r in job.link.records]
    assert steps == sorted(steps) and steps[-1] == stop, "history in order, up to the plan's stop"
