"""The job's metrics, exported through Ray's own metrics agent (`ray.util.metrics`).

Wherever a cluster's Prometheus scrapes Ray (each node's metrics export port), it finds these too,
with no server of ours. Ray prefixes every name with `ray_`; a counter is exported as `<name>_total`
and a histogram as `<name>_bucket`, `_count` and `_sum`. Every metric carries the job's name and run
id (`job_name`, `run`) and the policy; per-member ones carry the slot.

The coordinator exports what it already holds (committed records, events, status); a worker exports
its step times, observed when it sends a report (a batch of steps, a few times a second), never
inside a step. `METRICS` is the single list of what is exported (the Grafana board in
`dashboards/orchestrator.json` is checked against it).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PREFIX = "orchestrator_"
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
    Metric("committed_steps", "counter", "Committed steps (server kinds: versions; per-member kinds: each member's)"),
    Metric("samples", "counter", "Samples in committed steps (the global batch of each)"),
    Metric("tokens", "counter", "Tokens in committed steps (workloads that count them: the language models)"),
    Metric("loss", "gauge", "Training loss of the newest committed step"),
    Metric("eval", "gauge", "Newest evaluation metric", ("metric",)),
    Metric("world_size", "gauge", "Members of the newest plan"),
    Metric("membership_epoch", "gauge", "Membership epoch of the newest plan"),
    Metric("state", "gauge", "1 for the job's current state, 0 for the others", ("state",)),
    Metric("steps_per_second", "gauge", "Committed steps per second over the last 5 s"),
    Metric("tokens_per_second", "gauge", "Tokens per second over the last 5 s, all members (language models)"),
    Metric("bytes", "counter", "Bytes sent by the members, by what they carried", ("kind",)),
    Metric("recovery_seconds", "histogram", "A death or eviction -> the survivors' first committed step",
           ("detector",), SECONDS),
    Metric("join_seconds", "histogram", "A join decided -> its first committed step with the joiners", (), SECONDS),
    Metric("departures", "counter", "Members that left the job, by what found them", ("detector",)),
    Metric("joins", "counter", "Members admitted after the first plan", ("detector",)),
    Metric("step_time_ratio", "gauge", "A member's step time over the median member's (stragglers above 1)", ("slot",)),
    Metric("server_staleness", "gauge", "The parameter server's newest staleness (versions behind at a push)"),
    Metric("server_leases", "gauge", "The parameter server's or lease dispenser's leases, by state", ("lease",)),
    Metric("consensus_distance", "gauge", "Gossip: mean squared distance of the replicas to their average"),
    Metric("spares_ready", "gauge", "Hot spares started and ready"),
    Metric("worker_step_seconds", "histogram", "A member's step time (observed in its report batches)", ("slot",),
           STEP_SECONDS),
)}
BYTES_KIND = {"synchronous": "gradients", "periodic": "rounds", "decentralized": "exchanges",
              "server": "pushes", "background": "background rounds"}


def ray_metric(metric: Metric, defaults: dict[str, str]) -> Any:
    from ray.util import metrics as ray_metrics  # only where Ray runs

    name, keys = PREFIX + metric.name, BASE_TAGS + metric.tags
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
    """The coordinator's side: committed records, events and status into metrics.

    A record only updates a few sums and newest values here (a dictionary operation each); they go
    to Ray's metrics once a second and when the job ends (`flush`), so that a job whose members each
    report their own records (the per-member kinds, hundreds of members) costs one export a second,
    not one per record."""

    def __init__(self, exporter: Exporter, kind: str) -> None:
        self.x = exporter
        self.kind = kind
        self._bytes: dict[str, int] = {}
        """Each member's (or the job's) newest cumulative bytes_sent: a record's bytes are the difference."""
        self._step: dict[str, int] = {}
        self._state: str | None = None
        self._ticked = 0.0
        self._sums: dict[tuple, float] = {}
        self._newest: dict[tuple, float] = {}

    def record(self, record: dict) -> None:
        """A committed record, once (the newest one history took)."""
        who = record.get("slot", "")
        step = int(record["step"])
        steps = step - self._step.get(who, step - 1) if step > self._step.get(who, 0) else 0
        self._step[who] = max(step, self._step.get(who, 0))
        sums, newest = self._sums, self._newest
        if steps:
            sums[("committed_steps",)] = sums.get(("committed_steps",), 0) + steps
            batch = record.get("samples") or record.get("global_batch") or 0  # a member's own share, per-member kinds
            sums[("samples",)] = sums.get(("samples",), 0) + batch * steps
            if record.get("tokens"):
                sums[("tokens",)] = sums.get(("tokens",), 0) + int(record["tokens"]) * steps
        for name in ("loss", "world_size", "membership_epoch"):
            if record.get(name) is not None:
                newest[(name,)] = record[name]
        if record.get("consensus") is not None:
            newest[("consensus_distance",)] = record["consensus"]
        for metric, value in (record.get("metrics") or {}).items():
            if isinstance(value, (int, float)):
                newest[("eval", ("metric", str(metric)))] = value
        sent = record.get("bytes_sent")
        if sent is not None:
            before = self._bytes.get(who)
            self._bytes[who] = sent
            if before is not None and sent > before:
                key = ("bytes", ("kind", BYTES_KIND.get(self.kind, self.kind)))
                sums[key] = sums.get(key, 0) + sent - before
        if record.get("state_bytes"):
            key = ("bytes", ("kind", "state transfers"))
            sums[key] = sums.get(key, 0) + record["state_bytes"]

    def flush(self) -> None:
        """What records added since the last flush, into Ray's metrics."""
        sums, self._sums = self._sums, {}
        for (name, *tags), value in sums.items():
            self.x.inc(name, value, **dict(tags))
        newest, self._newest = self._newest, {}
        for (name, *tags), value in newest.items():
            self.x.set(name, value, **dict(tags))

    def event(self, event: Any) -> None:
        """An event of the journal: transitions, departures, reshapes (recovery and join times)."""
        if event.kind == "transition" and event.state_to:
            if self._state is not None:
                self.x.set("state", 0, state=self._state)
            self._state = event.state_to
            self.x.set("state", 1, state=event.state_to)
            if event.state_to in ("STOPPED", "FINISHED", "FAILED"):
                self.flush()  # the job's last values, before its coordinator goes
        elif event.kind == "reshape":
            detail = event.detail
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

    def tick(self, throughput: float | None, step_times: Callable[[], dict[str, float]], server: dict,
             spares: int, now: float | None = None, tokens_per_s: float | None = None) -> dict[str, float] | None:
        """What status shows, at most once a second. `step_times()`: each training member's step time;
        each one's ratio to the median goes out (a member that left keeps its last ratio, with its slot).
        Returns the step times when it ticked (the journal writes them too), else None."""
        now = time.monotonic() if now is None else now
        if now - self._ticked < 1.0:
            return None
        self._ticked = now
        self.flush()
        self.x.set("steps_per_second", throughput)
        if tokens_per_s is not None:
            self.x.set("tokens_per_second", tokens_per_s)
        times = step_times()
        if times:
            median = statistics.median(times.values())
            for slot, seconds in times.items():
                if median > 0:
                    self.x.set("step_time_ratio", seconds / median, slot=slot)
        if server:
            staleness = server.get("staleness")
            if isinstance(staleness, dict) and staleness:
                self.x.set("server_staleness", max(int(k) for k in staleness))
            for lease, count in (server.get("leases") or {}).items():
                if isinstance(count, (int, float)):
                    self.x.set("server_leases", count, lease=str(lease))
        self.x.set("spares_ready", spares)
        return times

