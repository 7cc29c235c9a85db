"""The job's metrics, exported through Ray's own metrics agent (`ray.util.metrics`).

Wherever a cluster's Prometheus scrapes Ray (each node's metrics export port), it finds these too,
with no server of ours. Ray prefixes every name with `ray_`; a counter is exported as `<name>_total`
and a histogram as `<name>_bucket`, `_count` and `_sum`. Every metric carries the job's name and run
id (`job_name`, `run`) and the policy.

The coordinator exports what it already holds (committed records, events, status) and the compute
time of each member's each step, which the members' reports carry. Series per slot (each member's
step-time ratio, and the histogram of its step times, which its worker exports) are opt-in
(`tracking.per_worker_metrics`): at 1,024 workers they are some 15k series a run, and Ray labels
whatever a worker process exports with its worker id anyway. `METRICS` is the single list of what is
exported (the Grafana board in `dashboards/orchestrator.json` is checked against it).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "orchestrator_"
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CHECKPOINT_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STALENESS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
"""Versions behind at a push (integers: the first bucket holds the fresh pushes, 0)."""


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter, gauge or histogram
    help: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name Prometheus sees (Ray's prefix; a counter's `_total`)."""
        return f"ray_{PREFIX}{self.name}" + ("_total" if self.kind == "counter" else "")


BASE_TAGS = ("job_name", "run", "policy")
"""`job_name`, not `job`: Prometheus gives each scraped series the target's `job` label, and renames a
clashing one to `exported_job` unless the scrape honours labels."""
METRICS = {m.name: m for m in (
    Metric("committed_steps", "counter", "The job's committed steps, as status counts them (server kinds: versions; "
                                         "per-member kinds: the slowest live member's steps); redone steps count again"),
    Metric("member_steps", "counter", "Per-member kinds: the steps each member committed, summed over the members"),
    Metric("samples", "counter", "Samples in committed steps (the global batch of each)"),
    Metric("tokens", "counter", "Tokens in committed steps (workloads that count them: the language models)"),
    Metric("loss", "gauge", "Training loss of the newest committed step"),
    Metric("grad_norm", "gauge", "The gradient's norm before clipping at the newest committed step (with "
                                 "optimizer.clip_grad_norm or fp16-mixed)"),
    Metric("skipped_updates", "gauge", "Updates skipped because their gradient was not finite (fp16-mixed), so far"),
    Metric("eval", "gauge", "Newest evaluation metric", ("metric",)),
    Metric("step_metric", "gauge", "A step metric the workload's loss returns beside the loss, as the newest "
                                   "committed step recorded it (aggregated over the members as the loss is)", ("metric",)),
    Metric("worker_tensor_bytes", "gauge", "With replica groups: what one worker (rank 0) holds of the training state at "
                                           "the membership epoch's start, in bytes, by part (parameters, gradients, "
                                           "optimizer, mirror: its copy of its neighbour's shard; total)", ("part",)),
    Metric("world_size", "gauge", "Members of the newest plan"),
    Metric("membership_epoch", "gauge", "Membership epoch of the newest plan"),
    Metric("state", "gauge", "1 for the job's current state, 0 for the others", ("state",)),
    Metric("steps_per_second", "gauge", "Committed steps per second over the newest records (the last 5 s, at least "
                                        "4 records; 0 in a stall)"),
    Metric("tokens_per_second", "gauge", "Tokens per second of wall clock over the newest records, all members (language models)"),
    Metric("last_commit_timestamp_seconds", "gauge", "Unix time of the newest committed step (stalls: time() minus it)"),
    Metric("bytes", "counter", "Bytes sent by the members, by what they carried", ("kind",)),
    Metric("recovery_seconds", "histogram", "A death or eviction -> the survivors' first committed step",
           ("detector",), SECONDS),
    Metric("join_seconds", "histogram", "A join decided -> its first committed step with the joiners", (), SECONDS),
    Metric("departures", "counter", "Members that left the job, by what found them", ("detector",)),
    Metric("joins", "counter", "Members admitted after the first plan", ("detector",)),
    Metric("step_compute_seconds", "histogram", "Compute time of each step of each member (forward and backward, "
                                                "until its gradients are in; no waiting on the others)", (), STEP_SECONDS),
    Metric("slowest_step_time_ratio", "gauge", "The slowest training member's step time over the median member's"),
    Metric("step_time_ratio", "gauge", "A member's step time over the median member's (stragglers above 1; 0 once "
                                       "it left); tracking.per_worker_metrics", ("slot",)),
    Metric("worker_step_compute_seconds", "histogram", "Compute time of each of a member's steps, exported by its "
                                                       "worker; tracking.per_worker_metrics", ("slot",), STEP_SECONDS),
    Metric("server_staleness", "histogram", "The parameter server's staleness of each push (versions behind)", (),
           STALENESS),
    Metric("server_leases", "counter", "Samples the parameter server or lease dispenser leased, and each lease's "
                                       "outcome (applied, dropped, requeued, lost)", ("state",)),
    Metric("server_leases_outstanding", "gauge", "Samples leased and not yet answered"),
    Metric("consensus_distance", "gauge", "Gossip: mean squared distance of the replicas to their average"),
    Metric("spares_ready", "gauge", "Hot spares started and ready"),
    Metric("checkpoints", "counter", "Checkpoints stored"),
    Metric("checkpoint_bytes", "counter", "Bytes of the checkpoints stored"),
    Metric("checkpoint_seconds", "histogram", "Time to store a checkpoint", (), CHECKPOINT_SECONDS),
    Metric("checkpoint_failures", "counter", "Failed tries to store a checkpoint: retried, given_up, or replaced (a "
                                             "newer one took its place while it waited)", ("outcome",)),
    Metric("checkpoint_step", "gauge", "Step of the newest checkpoint stored (what a loss of every member restarts from)"),
    Metric("checkpoint_timestamp_seconds", "gauge", "Unix time the newest checkpoint was stored"),
    Metric("storage_errors", "counter", "Failures to copy the run to its storage (each new one once, while retried)"),
    Metric("storage_mirror_lag_seconds", "gauge", "Seconds since the run's copy on its storage last took every upload "
                                                  "(grows while the store fails; 0 without remote storage)"),
    Metric("incarnation", "gauge", "Restarts so far of the coordinator or the parameter server (its incarnation; "
                                   "the series appears at the first restart)", ("component",)),
)}
def ray_metric(metric: Metric, defaults: dict[str, str]) -> Any:
    from ray.util import metrics as ray_metrics  # only where Ray runs

    name, keys = PREFIX + metric.name, BASE_TAGS + metric.tags
    made: Any
    if metric.kind == "counter":
        made = ray_metrics.Counter(name, metric.help, tag_keys=keys)
    elif metric.kind == "gauge":
        made = ray_metrics.Gauge(name, metric.help, tag_keys=keys)
    else:
        made = ray_metrics.Histogram(name, metric.help, boundaries=list(metric.boundaries), tag_keys=keys)
    return made.set_default_tags(defaults)


class Exporter:
    """The metrics of one job run, made on first use (a metric costs Ray a registration)."""

    def __init__(self, job: str, run: str, policy: str, enabled: bool = True, make=ray_metric) -> None:
        self.defaults = {"job_name": job, "run": run, "policy": policy}
        self.enabled = enabled
        self._make = make
        self._made: dict[str, Any] = {}

    def _metric(self, name: str) -> Any:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._make(METRICS[name], self.defaults)
        return made

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if self.enabled and value > 0:
            self._metric(name).inc(value, tags=tags or None)

    def set(self, name: str, value: float | None, **tags: str) -> None:
        if self.enabled and value is not None:
            self._metric(name).set(float(value), tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        if self.enabled:
            self._metric(name).observe(float(value), tags=tags or None)


class JobMetrics:
    """The coordinator's side: committed records, step times, events and status into metrics.

    A record or a report's step times only update a few sums and newest values here (a dictionary
    operation each); they go to Ray's metrics once a second and when the job ends (`flush`), so that
    a job whose members each report their own records (the per-member kinds, hundreds of members)
    costs one export a second, not one per record. The job's step (`job_step()`, as status has it)
    is read at each flush: its increase is the committed steps."""

    def __init__(self, exporter: Exporter, traffic: str, job_step: Callable[[], int], per_worker: bool = False) -> None:
        """`traffic`: what the members' bytes carry, the `bytes` metric's `kind` label (the policy kind's `traffic`)."""
        self.x = exporter
        self.traffic = traffic
        self.per_worker = per_worker
        self._job_step = job_step
        self._exported_step = 0
        self._bytes: dict[str, int] = {}
        """Each member's (or the job's) newest cumulative bytes_sent: a record's bytes are the difference."""
        self._step: dict[str, int] = {}
        self._state: str | None = None
        self._ticked = 0.0
        self._sums: dict[tuple, float] = {}
        self._newest: dict[tuple, float] = {}
        self._step_s: list[float] = []
        self._counts: dict[str, dict[str, float]] = {}
        """The server's newest cumulative counts, by family (staleness, leases): what the next ones add."""
        self._ratios: set[str] = set()
        """The slots whose step-time ratio is exported (one that leaves goes to 0)."""
        self._tokens_rate = False
        self._last_commit = 0.0
        self._checkpoint_step = -1

    def record(self, record: dict) -> None:
        """A committed record, once (the newest one history took)."""
        who = record.get("slot", "")
        step = int(record["step"])
        steps = step - self._step.get(who, step - 1) if step > self._step.get(who, 0) else 0
        self._step[who] = max(step, self._step.get(who, 0))
        sums, newest = self._sums, self._newest
        if steps:
            if who:  # a per-member kind's member: the job's steps are its step's (flush)
                sums[("member_steps",)] = sums.get(("member_steps",), 0) + steps
            batch = record.get("samples") or record.get("global_batch") or 0  # a member's own share, per-member kinds
            sums[("samples",)] = sums.get(("samples",), 0) + batch * steps
            if record.get("tokens"):
                sums[("tokens",)] = sums.get(("tokens",), 0) + int(record["tokens"]) * steps
        for name in ("loss", "world_size", "membership_epoch", "grad_norm", "skipped_updates"):
            if record.get(name) is not None:
                newest[(name,)] = record[name]
        if record.get("consensus") is not None:
            newest[("consensus_distance",)] = record["consensus"]
        for metric, value in (record.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                newest[("eval", ("metric", str(metric)))] = value
        for metric, value in (record.get("step_metrics") or {}).items():
            newest[("step_metric", ("metric", str(metric)))] = value
        for part, value in (record.get("tensor_bytes") or {}).items():
            newest[("worker_tensor_bytes", ("part", str(part)))] = value
        if record.get("time") is not None and record["time"] > self._last_commit:
            self._last_commit = newest[("last_commit_timestamp_seconds",)] = float(record["time"])
        self._sent(who, record)

    def _sent(self, who: str, record: dict) -> None:
        sent = record.get("bytes_sent")
        if sent is not None:
            before = self._bytes.get(who)
            self._bytes[who] = sent
            if before is not None and sent > before:
                key = ("bytes", ("kind", self.traffic))
                self._sums[key] = self._sums.get(key, 0) + sent - before
        if record.get("state_bytes"):
            key = ("bytes", ("kind", "state transfers"))
            self._sums[key] = self._sums.get(key, 0) + record["state_bytes"]

    def steps(self, seconds: Sequence[float]) -> None:
        """A member's report: the compute time of each of its steps since its previous report."""
        if self.x.enabled:
            self._step_s.extend(seconds)

    def flush(self) -> None:
        """What came since the last flush, into Ray's metrics."""
        step = self._job_step()
        if step > self._exported_step:
            self.x.inc("committed_steps", step - self._exported_step)
        self._exported_step = step  # lower after a restore or a server's rewind: the redone steps count again
        sums, self._sums = self._sums, {}
        for (name, *tags), value in sums.items():
            self.x.inc(name, value, **dict(tags))
        newest, self._newest = self._newest, {}
        for (name, *tags), value in newest.items():
            self.x.set(name, value, **dict(tags))
        step_s, self._step_s = self._step_s, []
        for seconds in step_s:
            self.x.observe("step_compute_seconds", seconds)

    def close(self) -> None:
        """Nothing to let go of: Ray's metrics agent exports what was set."""

    def event(self, event: Any) -> None:
        """An event of the journal: transitions, reshapes (recovery and join times), checkpoints,
        storage failures, restarts."""
        detail = event.detail
        if event.kind == "transition" and event.state_to:
            if self._state is not None:
                self.x.set("state", 0, state=self._state)
            self._state = event.state_to
            self.x.set("state", 1, state=event.state_to)
            if event.state_to in ("STOPPED", "FINISHED", "FAILED"):
                self.flush()  # the job's last values, before its coordinator goes
        elif event.kind == "reshape":
            self._reshape(detail)
        elif event.kind in ("checkpoint", "checkpoint_failed"):
            self._checkpoint(event)
        elif event.kind == "info" and event.reason.startswith("storage:"):
            self.x.inc("storage_errors")
        elif event.kind == "restart" and detail.get("incarnation") is not None:
            self.x.set("incarnation", detail["incarnation"], component="coordinator")
        elif event.kind == "server" and detail.get("server_incarnation") is not None:
            self.x.set("incarnation", detail["server_incarnation"], component="server")

    def _reshape(self, detail: dict) -> None:
        duration, detector = detail.get("duration_s"), str(detail.get("detector", ""))
        gone = set(detail.get("old_members") or ()) - set(detail.get("new_members") or ())
        if gone:
            self.x.inc("departures", len(gone), detector=detector)
        if detail.get("joiners"):
            self.x.inc("joins", len(detail["joiners"]), detector=detector)
            if duration is not None:
                self.x.observe("join_seconds", duration)
        elif gone and not detail.get("leavers") and duration is not None:  # a scale-down is no recovery
            self.x.observe("recovery_seconds", duration, detector=detector)

    def _checkpoint(self, event: Any) -> None:
        detail = event.detail
        if event.kind == "checkpoint_failed":
            outcome = "replaced" if "replaced_by" in detail else "retried" if detail.get("retry") else "given_up"
            self.x.inc("checkpoint_failures", outcome=outcome)
            return
        self.x.inc("checkpoints")
        self.x.inc("checkpoint_bytes", detail.get("bytes") or 0)
        if detail.get("seconds") is not None:
            self.x.observe("checkpoint_seconds", detail["seconds"])
        step = detail.get("step")
        if step is not None and step >= self._checkpoint_step:
            self._checkpoint_step = step
            self.x.set("checkpoint_step", step)
            self.x.set("checkpoint_timestamp_seconds", event.time)

    def tick(self, throughput: float | None, step_times: Callable[[], dict[str, float]], server: dict,
             spares: int, now: float | None = None, tokens_per_s: float | None = None,
             mirror_lag_s: float | None = None) -> dict[str, float] | None:
        """What status shows, at most once a second. `step_times()`: each training member's step time.
        A rate that is None (no steps in the last 5 s: a stall) goes out as 0. Returns the step times
        when it ticked (the journal writes them too), else None."""
        now = time.monotonic() if now is None else now
        if now - self._ticked < 1.0:
            return None
        self._ticked = now
        self.flush()
        self.x.set("steps_per_second", throughput or 0.0)
        self._tokens_rate = self._tokens_rate or tokens_per_s is not None
        if self._tokens_rate:
            self.x.set("tokens_per_second", tokens_per_s or 0.0)
        times = step_times()
        self._ratios_of(times)
        if server:
            self._server(server)
        self.x.set("spares_ready", spares)
        if mirror_lag_s is not None:
            self.x.set("storage_mirror_lag_seconds", mirror_lag_s)
        return times

    def _ratios_of(self, times: dict[str, float]) -> None:
        """The slowest member's step time over the median's; with per-worker metrics, each member's (0
        for one that left, which is no straggler any more)."""
        median = statistics.median(times.values()) if times else 0.0
        if median > 0:
            self.x.set("slowest_step_time_ratio", max(times.values()) / median)
        if not self.per_worker:
            return
        for slot, seconds in times.items():
            if median > 0:
                self.x.set("step_time_ratio", seconds / median, slot=slot)
        for slot in self._ratios - times.keys():
            self.x.set("step_time_ratio", 0.0, slot=slot)
        self._ratios = set(times)

    def _server(self, summary: dict) -> None:
        """The server's cumulative counts: each push's staleness into the histogram, the leases' samples
        into their counters (what each count grew by since the last summary)."""
        staleness = summary.get("staleness")
        if isinstance(staleness, dict):
            for versions, pushes in self._grown("staleness", staleness).items():
                for _ in range(int(pushes)):
                    self.x.observe("server_staleness", int(versions))
        leases = {k: v for k, v in (summary.get("leases") or {}).items() if isinstance(v, (int, float))}
        if "outstanding" in leases:
            self.x.set("server_leases_outstanding", leases.pop("outstanding"))
        for state, samples in self._grown("leases", leases).items():
            self.x.inc("server_leases", samples, state=str(state))

    def _grown(self, family: str, counts: dict) -> dict[str, float]:
        """What each cumulative count grew by since the last summary. When one shrank, the server restarted
        (its counts start again from its snapshot's, or from nothing): these are the new base, and what
        the lost incarnation counted after its snapshot stays counted."""
        before = self._counts.get(family, {})
        self._counts[family] = dict(counts)
        if any(counts.get(key, 0) < value for key, value in before.items()):
            return {}
        return {key: value - before.get(key, 0) for key, value in counts.items() if value > before.get(key, 0)}
