"""Each metric means what its name and help say (actors/observe/metrics.py), tested without Ray through fake
metrics: step times are each step's, not a smoothed value per report; cumulative counts are counters
and staleness a histogram of pushes; job steps and member steps are apart; rates fall to 0 in a stall;
per-slot series are opt-in; checkpoints, storage errors, restarts and the last commit are exported."""
from __future__ import annotations

import time
import types

import pytest

from actors.control import journal as journal_module
from actors.control.journal import Journal
from actors.observe.metrics import METRICS, Exporter, JobMetrics
from algorithms.rules.kinds import Reporter
from core.schema import Event, TrackingConfig, parse
from testkit.fake_workers import FakeMetric
from testkit.stores import HookedStore

STEPS, SLOW_S = 30, 0.3


def fake_exporter(made: dict[str, FakeMetric]) -> Exporter:
    def make(metric, defaults):
        made[metric.name] = FakeMetric(metric.kind)
        return made[metric.name]
    return Exporter("j", "r", "bsp", make=make)


def event(kind: str, reason: str = "", **detail) -> Event:
    return Event(time=time.time(), kind=kind, reason=reason, detail=detail)


@pytest.fixture(scope="module")
def replica_reports(tmp_path_factory):
    """A real replica's progress reports (`LocalJob`: the worker's step loop in a thread), its last step
    slowed by SLOW_S (a modelled straggler, which counts as compute)."""
    from testkit.harness import LocalJob

    cfg = {"name": "steps", "seed": 1, "workers": {"count": 1, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 8},
           "optimizer": {"lr": 0.1}, "stop": {"max_steps": STEPS}, "eval_every": 0,
           "faults": {"stragglers": [{"slot": "w0", "delay_s": SLOW_S, "from_step": STEPS - 1}]}}
    job = LocalJob(cfg, ["w0"], str(tmp_path_factory.mktemp("steps")))
    kept: list = []
    report = job.link.report
    job.link.report = lambda progress, wait: (kept.append(progress), report(progress, wait))  # type: ignore[method-assign]
    job.run(("w0",), 8)
    assert kept and kept[-1].step == STEPS
    return kept, job.config


def test_each_step_s_compute_time_is_observed_once_with_its_tail(replica_reports, monkeypatch):
    """The job-wide histogram (the coordinator's) and the opt-in per-slot one (the worker's) both hold one
    observation per step, the slow last step among them: not an average per report, which hides it."""
    reports, config = replica_reports
    made: dict[str, FakeMetric] = {}
    metrics = JobMetrics(fake_exporter(made), "gradients", lambda: 0)
    for progress in reports:
        metrics.steps(progress.step_s)
    metrics.flush()
    job_wide = made["step_compute_seconds"].values[()]
    assert len(job_wide) == STEPS, f"{len(job_wide)} observations for {STEPS} steps in {len(reports)} reports"
    assert max(job_wide) >= SLOW_S and sorted(job_wide)[-2] < SLOW_S, "the one slow step is seen as it was"

    from actors.plan import WorkerSpec
    from actors.training import worker

    worker_made: dict[str, FakeMetric] = {}
    monkeypatch.setattr(worker, "Exporter", lambda *a, **k: Exporter(*a, make=fake_exporter(worker_made)._make, **k))
    sent = []
    handle = types.SimpleNamespace(report=types.SimpleNamespace(remote=lambda *a, **k: sent.append(a)))
    for per_worker in (False, True):
        worker_made.clear()
        spec = WorkerSpec("j", "r", "w0", "/tmp", "c", "ns", {**config, "tracking": {"per_worker_metrics": per_worker}})
        link = worker.RayLink(spec, coordinator=handle)
        for progress in reports:
            link.report(progress, wait=False)
        if not per_worker:
            assert worker_made == {}, "no per-slot series unless tracking.per_worker_metrics"
            continue
        observed = worker_made["worker_step_compute_seconds"].values[(("slot", "w0"),)]
        assert observed == job_wide, "the worker observes each step's time, as the coordinator does"


def test_leases_are_counters_outstanding_a_gauge_and_staleness_a_histogram_of_pushes():
    assert METRICS["server_leases"].kind == "counter", "cumulative lease counts are counters"
    assert METRICS["server_staleness"].kind == "histogram", "staleness of each push, not the maximum ever seen"
    made: dict[str, FakeMetric] = {}
    metrics = JobMetrics(fake_exporter(made), "pushes", lambda: 0)
    summaries = [{"staleness": {"0": 3, "2": 1}, "leases": {"leased": 10, "applied": 8, "outstanding": 2}},
                 {"staleness": {"0": 5, "2": 1, "7": 2}, "leases": {"leased": 25, "applied": 20, "outstanding": 5}},
                 {"staleness": {"0": 1}, "leases": {"leased": 4, "applied": 0, "outstanding": 4}},  # a restarted table
                 {"staleness": {"0": 2}, "leases": {"leased": 6, "applied": 2, "outstanding": 4}}]
    for second, summary in enumerate(summaries):
        metrics.tick(None, dict, summary, 0, now=float(second))
    assert made["server_leases"].values == {(("state", "leased"),): 25 + 2, (("state", "applied"),): 20 + 2}, \
        "a restart's counts are the new base"
    assert made["server_leases_outstanding"].values[()] == 4
    assert sorted(made["server_staleness"].values[()]) == [0] * 5 + [0] + [2, 7, 7]


def test_committed_steps_are_the_job_s_and_member_steps_count_apart():
    """A per-member kind: members step on their own; the job's step is the slowest live member's (status)."""
    made: dict[str, FakeMetric] = {}
    job_step = {"now": 0}
    metrics = JobMetrics(fake_exporter(made), "exchanges", lambda: job_step["now"])
    for step in range(1, 11):
        for slot, ahead in (("w0", 0), ("w1", 2)):
            metrics.record({"step": step + ahead, "time": 1000.0 + step, "slot": slot, "samples": 8})
    job_step["now"] = 10
    metrics.tick(None, dict, {}, 0, now=1.0)
    assert made["committed_steps"].values[()] == 10, "the job's steps, as status counts them"
    assert made["member_steps"].values[()] == 10 + 10, "each member's steps, summed (from its first record)"
    assert made["samples"].values[()] == 8 * 20
    one = {}
    lockstep = JobMetrics(fake_exporter(one), "gradients", lambda: job_step["now"])
    for step in range(11, 16):
        lockstep.record({"step": step, "time": 1000.0 + step, "global_batch": 16})
    job_step["now"] = 15
    lockstep.flush()
    assert one["committed_steps"].values[()] == 15 and "member_steps" not in one
    job_step["now"] = 12  # a restore to the checkpoint at step 12: steps 13.. are committed again
    lockstep.flush()
    job_step["now"] = 16
    lockstep.flush()
    assert one["committed_steps"].values[()] == 15 + 4


def test_throughput_falls_to_zero_in_a_stall(tmp_path, monkeypatch):
    """Status (the journal) and the gauge, 100 s into a stall, after 10 steps/s."""
    journal = Journal(tmp_path, keep_checkpoints=2)
    journal.open_history(Reporter.RANK0, 0)
    now = time.time()
    for step in range(1, 101):
        journal.offer({"step": step, "time": now - 10 + step / 10, "loss": 1.0, "world_size": 1, "global_batch": 8,
                       "membership_epoch": 1})
    assert journal.throughput() == pytest.approx(10.0)
    later = types.SimpleNamespace(time=lambda: time.time() + 100, monotonic=lambda: time.monotonic() + 100)
    monkeypatch.setattr(journal_module, "time", later)
    assert journal.throughput() is None, f"{journal.throughput()} steps/s 100 s into a stall"
    journal.history.close()
    journal.close()

    made: dict[str, FakeMetric] = {}
    metrics = JobMetrics(fake_exporter(made), "gradients", lambda: 0)
    metrics.tick(10.0, dict, {}, 0, now=1.0, tokens_per_s=500.0)
    metrics.tick(None, dict, {}, 0, now=3.0, tokens_per_s=None)
    assert made["steps_per_second"].values[()] == 0.0 and made["tokens_per_second"].values[()] == 0.0


def test_per_slot_series_are_opt_in_and_a_departed_slot_falls_to_zero():
    assert parse(TrackingConfig, {}).per_worker_metrics is False
    times = {"w0": 0.01, "w1": 0.03, "w2": 0.01}
    made: dict[str, FakeMetric] = {}
    JobMetrics(fake_exporter(made), "gradients", lambda: 0).tick(None, lambda: times, {}, 0, now=1.0)
    assert "step_time_ratio" not in made, "no series per slot by default (1,024 workers: 1,024 series)"
    assert made["slowest_step_time_ratio"].values[()] == 3.0
    made.clear()
    metrics = JobMetrics(fake_exporter(made), "gradients", lambda: 0, per_worker=True)
    metrics.tick(None, lambda: times, {}, 0, now=1.0)
    metrics.tick(None, lambda: {"w0": 0.01, "w2": 0.02}, {}, 0, now=2.0)
    assert made["step_time_ratio"].values == {(("slot", "w0"),): pytest.approx(2 / 3), (("slot", "w1"),): 0.0,
                                              (("slot", "w2"),): pytest.approx(4 / 3)}, "w1 left: it is no straggler"


def test_checkpoints_storage_errors_restarts_and_the_last_commit_are_exported():
    made: dict[str, FakeMetric] = {}
    metrics = JobMetrics(fake_exporter(made), "pushes", lambda: 0)
    metrics.event(event("checkpoint", "checkpoint at step 10", step=10, path="/x/10", bytes=1000, seconds=0.5))
    metrics.event(event("checkpoint", "checkpoint at step 20", step=20, path="/x/20", bytes=3000))
    for attempt, retry in ((1, True), (2, False)):
        metrics.event(event("checkpoint_failed", "no checkpoint at step 30", step=30, error="OSError: disk full",
                            attempt=attempt, retry=retry))
    metrics.event(event("checkpoint_failed", "step 40 replaced", step=40, replaced_by=50, error="replaced while waiting",
                        attempt=0, retry=False))
    metrics.event(event("info", "storage: could not upload new lines of history.jsonl to s3://b/j/r: timeout "
                                "(retrying): the run's remote copy lags", error="storage: ..."))
    metrics.event(event("info", "TensorBoard failed and goes on without that record"))
    metrics.event(event("restart", "coordinator restarted as incarnation 2", incarnation=2))
    metrics.event(event("server", "parameter server restarted as incarnation 1", server_incarnation=1))
    metrics.record({"step": 1, "time": 1234.5})
    metrics.record({"step": 2, "time": 1236.0})
    metrics.flush()
    assert made["checkpoints"].values[()] == 2 and made["checkpoint_bytes"].values[()] == 4000
    assert made["checkpoint_seconds"].values[()] == [0.5]
    assert made["checkpoint_failures"].values == {(("outcome", "retried"),): 1, (("outcome", "given_up"),): 1,
                                                  (("outcome", "replaced"),): 1}
    assert made["checkpoint_step"].values[()] == 20
    assert made["storage_errors"].values[()] == 1
    assert made["incarnation"].values == {(("component", "coordinator"),): 2, (("component", "server"),): 1}
    assert made["last_commit_timestamp_seconds"].values[()] == 1236.0


def test_the_storage_copys_lag_is_exported_and_grows_while_the_store_fails(tmp_path):
    import threading

    from actors.runs.mirror import RunMirror
    from actors.runs.storage import open_storage

    down = threading.Event()

    def unless_down(key, data):
        if down.is_set():
            raise OSError("503 Service Unavailable")
    (tmp_path / "run").mkdir()
    mirror = RunMirror(HookedStore(open_storage(str(tmp_path / "store")), unless_down), "job/run", tmp_path / "run",
                       interval_s=0.05).start()
    assert mirror.flush(10) and mirror.lag_s() < 5
    down.set()
    (tmp_path / "run" / "status.json").write_text("{}")
    mirror.put("status.json")
    assert not mirror.flush(0.5)
    lag = mirror.lag_s()
    assert lag >= 0.4, lag
    made: dict[str, FakeMetric] = {}
    metrics = JobMetrics(fake_exporter(made), "gradients", lambda: 0)
    metrics.tick(None, lambda: {}, {}, 0, now=100.0, mirror_lag_s=lag)
    assert made["storage_mirror_lag_seconds"].values[()] == lag
    down.clear()
    assert mirror.flush(10) and mirror.lag_s() < lag
    mirror.close()
