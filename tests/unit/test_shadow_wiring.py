"""`shadow` through the real worker loop, in process (no Ray): `LocalJob` runs real replicas in threads
with the lease dispenser in process. Per-member history, one evaluator (rank 0, on the replicas'
newest average), the dispenser's accounting, and a joiner that receives a live member's state."""
from __future__ import annotations

from testkit.harness import LocalJob, wait_until

PER_WORKER = 8


def config(steps: int, **sync) -> dict:
    return {"name": "shadow-wiring", "seed": 2, "workers": {"count": 3, "cpus": 1, "batch_mode": "keep_worker"},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": PER_WORKER},
            "optimizer": {"lr": 0.1, "momentum": 0.5}, "sync": {"policy": "shadow", **sync},
            "stop": {"max_steps": steps}, "eval_every": 10, "faults": {"stragglers": []}}


def test_each_member_reports_its_steps_rank0_evaluates_the_average_and_the_leases_add_up(tmp_path):
    steps = 40
    job = LocalJob(config(steps), ["w0", "w1", "w2"], str(tmp_path))
    job.run(("w0", "w1", "w2"), 3 * PER_WORKER)
    by_slot = {s: [r["step"] for r in job.link.records if r["slot"] == s] for s in ("w0", "w1", "w2")}
    assert by_slot == {s: list(range(1, steps + 1)) for s in by_slot}
    evaluated = {r["slot"] for r in job.link.records if "metrics" in r}
    assert evaluated == {"w0"}, "rank 0 alone evaluates (the replicas' average, the same for everyone)"
    rounds = [r["rounds"] for r in job.link.records if r["slot"] == "w0"]
    assert rounds == sorted(rounds) and all("wait_s" in r for r in job.link.records)
    impl = job.replicas["w0"].policy.impl
    assert rounds[-1] >= 1 and impl.sync.average is not None, "no background round completed in 40 steps"
    assert impl.eval_parameters() is impl.sync.average, "the evaluation looks at the newest round's average"
    job.server.close("the test ended", 30.0)
    leases = job.server.summary()["leases"]
    assert leases["applied"] == sum(r["samples"] for r in job.link.records) == 3 * steps * PER_WORKER
    assert leases["applied"] + leases["requeued"] + leases["lost"] == leases["leased"] and leases["outstanding"] == 0


def test_a_joiner_receives_a_live_members_state_and_the_others_never_wait_for_it(tmp_path):
    steps = 400
    cfg = config(steps)
    cfg["faults"]["stragglers"] = [{"slot": s, "delay_s": 0.01} for s in ("w0", "w1", "w2")]
    job = LocalJob(cfg, ["w0", "w1", "w2"], str(tmp_path))
    job.publish(("w0", "w1"), 1, 2 * PER_WORKER)
    job.start(["w0", "w1"])
    wait_until(lambda: job.replicas["w0"].training.step >= 20, timeout=60, what="w0 at step 20")
    published_at = job.replicas["w0"].training.step
    job.publish(("w0", "w1", "w2"), 2, 3 * PER_WORKER)
    # the joiner's process is slow to come up: it starts only once w0 has committed 10 more steps in the
    # new epoch (members that waited for the joiner would never get there: the test fails on its deadline)
    wait_until(lambda: job.replicas["w0"].training.step >= published_at + 10 and job.replicas["w0"].plan.membership_epoch == 2,
               timeout=60, what="w0 training on in the new epoch without the joiner")
    job.start(["w2"])
    received = wait_until(lambda: [c for c in job.link.calls if c[0] == "state_received"], timeout=60,
                          what="the joiner's state")
    slot, epoch, source, step = received[0][1]
    assert slot == "w2" and epoch == 2 and source in ("w0", "w1") and step >= 20, received
    # the joiner's first record, as the link has it (its step counter moves before its report is flushed)
    joined = wait_until(lambda: [r["step"] for r in job.link.records if r["slot"] == "w2"], timeout=60,
                        what="the joiner's first step")
    first = min(joined)
    assert first == step + 1, "the joiner goes on from its source's step"
    job.publish(("w0", "w1", "w2"), 3, 3 * PER_WORKER, stop_step=0)  # everyone stops at once
    outcomes = job.wait(timeout=60)
    assert all(o.ok for o in outcomes.values()), outcomes
    stamps = sorted(r["time"] for r in job.link.records if r["slot"] == "w0")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"w0's steps while w2 joined: median {sorted(gaps)[len(gaps) // 2] * 1000:.1f} ms, largest {max(gaps) * 1000:.1f} ms")


def test_a_failed_background_round_is_reported_again_while_no_re_form_comes(tmp_path):
    """The coordinator may drop a re-form request (its rate limit, a probe under way); here the link
    never re-forms at all. A member whose background group broke must keep asking, once per
    collective timeout, rather than train on without background sync for the rest of the epoch."""
    cfg = config(100_000)
    cfg["faults"]["stragglers"] = [{"slot": s, "delay_s": 0.01} for s in ("w0", "w1")]
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path), timeout_s=1.0)
    job.publish(("w0", "w1"), 1, 2 * PER_WORKER)
    job.start(["w0", "w1"])
    w0 = job.replicas["w0"].policy.impl
    wait_until(lambda: w0.sync.stats.rounds_completed >= 1, timeout=60, what="a first background round")
    w0._group.abort("test: the background group breaks")
    reports = lambda: [c for c in job.link.calls if c[0] == "collective_failed" and c[1][0] == "w0"]  # noqa: E731
    wait_until(lambda: len(reports()) >= 3, timeout=20, what="w0 asking again for a re-form")
    assert all(c[1][1] == 1 for c in reports()), "each request names the broken epoch"
    job.publish(("w0", "w1"), 2, 2 * PER_WORKER, stop_step=0)
    outcomes = job.wait(timeout=60)
    assert all(o.ok for o in outcomes.values()), outcomes
