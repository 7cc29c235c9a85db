"""The job's metrics on the local Ray node's Prometheus endpoint, through a kill and a replacement's
join, against `status()` and history: committed steps, world size back to its count, one recovery
observation per death, the join, the last commit's time; each step's compute time, job-wide (the
coordinator's) and per slot (each worker's, with tracking.per_worker_metrics)."""
from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from actors.observe.metrics import METRICS
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import paced, wait_until


def scrape() -> dict[str, list]:
    """Every sample on this node's metrics endpoint, by sample name: [(labels, value)]."""
    node = next(n for n in ray.nodes() if n["Alive"])
    text = urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                                  timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict, name: str, run: str, **labels: str) -> float:
    """The sum over the run's series of `name` whose labels include `labels`."""
    return sum(v for tags, v in samples.get(name, []) if tags.get("run") == run
               and all(tags.get(k) == want for k, want in labels.items()))


def test_the_job_s_metrics_on_ray_s_endpoint_match_status_and_history(run_root):
    """The job runs until the replacement of the killed w1 has joined and trained 10 steps, then is stopped
    (it ends on those events, not at a step count it must reach first); its metrics on Ray's endpoint are
    read while the stopped coordinator stays (until the driver releases it)."""
    cfg = {"name": "metrics", "seed": 3, "workers": {"count": 3, "cpus": 0.5, "start_grace_s": 600},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 1_000_000}, "eval_every": 0,
           "tracking": {"tensorboard": "tb", "report": True, "per_worker_metrics": True},
           "faults": {"kills": [{"slot": "w1", "step": 20, "at": "step"}]}}
    job = ElasticJob(config_from_dict(paced(cfg))).start()
    try:
        job.wait_for(step=11)
        run = job.status().run_id
        # each worker process exports on its own (Ray's report interval): wait for both survivors' step times
        wait_until(lambda: (s := scrape()) and all(value(s, "ray_orchestrator_worker_step_compute_seconds_count", run,
                                                         slot=slot) > 0 for slot in ("w0", "w2")),
                   timeout=15, what="the workers' step times", every=0.5)
        joined = job.wait_for(lambda e: e["kind"] == "reshape" and e["detail"]["joiners"] == ["w1"], timeout=120)
        job.wait_for(step=joined["detail"]["first_committed_step"] + 10)
        job._ask(lambda c: c.request_stop.remote("the test saw the join and 10 steps after it"))  # stop() would also release it
        status = wait_until(lambda: (s := job.status()).state in ("STOPPED", "FAILED") and s, timeout=120,
                            what="the end (the coordinator stays until released: its metrics too)")
        assert status.state == "STOPPED" and status.world_size == 3, status
        history = job.history()
        reshapes = [e for e in job.events() if e["kind"] == "reshape"]
        deaths = [e for e in reshapes if "w1" in e["detail"]["old_members"] and "w1" not in e["detail"]["new_members"]]
        joins = [e for e in reshapes if e["detail"]["joiners"]]
        assert len(deaths) == 1 and len(joins) == 1, [e["detail"]["detector"] for e in reshapes]
        detector = deaths[0]["detail"]["detector"]  # Ray's notice or the survivors' failed collective, whichever came first

        def settled():  # the coordinator's last values reach the endpoint within a report interval; Ray exports each
            samples = scrape()  # metric on its own, so one counter can be seen ahead of another (a CI run: steps, not samples)
            return samples if (value(samples, METRICS["committed_steps"].exported, run) == len(history) and
                               value(samples, "ray_orchestrator_samples_total", run) == sum(r["global_batch"] for r in history)
                               and value(samples, "ray_orchestrator_step_compute_seconds_count", run) >= len(history)) \
                else None
        samples = wait_until(settled, timeout=15, what="the committed steps and samples on the endpoint", every=0.5)
        print({k: [v for t, v in s if t.get("run") == run] for k, s in samples.items() if "orchestrator" in k})
        assert len(history) == status.step
        assert value(samples, "ray_orchestrator_samples_total", run) == sum(r["global_batch"] for r in history)
        assert value(samples, "ray_orchestrator_world_size", run) == 3
        assert value(samples, "ray_orchestrator_membership_epoch", run) == history[-1]["membership_epoch"]
        assert value(samples, "ray_orchestrator_recovery_seconds_count", run, detector=detector) == len(deaths)
        duration = deaths[0]["detail"]["duration_s"]  # its bucket (Ray's exported _sum is from bucket midpoints)
        buckets = sorted((float(t["le"]), v) for t, v in samples["ray_orchestrator_recovery_seconds_bucket"]
                         if t.get("run") == run)
        below = [v for le, v in buckets if le < duration]
        above = [v for le, v in buckets if le >= duration]
        assert (below[-1] if below else 0) == 0 and above[0] == 1, (duration, buckets)
        assert value(samples, "ray_orchestrator_departures_total", run, detector=detector) == 1
        assert value(samples, "ray_orchestrator_join_seconds_count", run) == 1
        assert value(samples, "ray_orchestrator_state", run, state="STOPPED") == 1
        assert value(samples, "ray_orchestrator_bytes_total", run, kind="gradients") > 0
        assert value(samples, "ray_orchestrator_loss", run) == pytest.approx(history[-1]["loss"])
        assert value(samples, "ray_orchestrator_last_commit_timestamp_seconds", run) == pytest.approx(history[-1]["time"])
        tags = next(t for t, _ in samples["ray_orchestrator_world_size"] if t.get("run") == run)
        assert tags["job_name"] == "metrics" and tags["policy"] == "bsp"
    finally:
        result = job.wait(timeout=60)
    # the coordinator drew the run report before it went, and TensorBoard holds history step for step
    png = Path(result.run_dir) / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(png.parent / "tb"), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in history]
    assert [(e.step, e.value) for e in acc.Scalars("world_size")] == [(r["step"], r["world_size"]) for r in history]
