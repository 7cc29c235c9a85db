"""`ElasticJob`: the one driver-side API that the CLI, notebooks and tests share.

`start()` connects to Ray (a local Ray sized for the job when there is no address and no
existing connection), creates the detached coordinator named after the job in the
`orchestrator` namespace, and returns at once. `attach(name)` reaches a running job from any
process without re-initializing Ray. After the coordinator is gone, `status()`, `history()`,
`events()` and `model()` read the run directory, found through Ray's KV store.

The helpers live beside it: connecting to Ray (`orchestrator/connection.py`), where the runs are kept
(`orchestrator/run_storage.py`), reaching the coordinator actor (`orchestrator/coordinator_handle.py`);
the names callers import from here are re-exported.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import ray
import yaml

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from ray.actor import ActorHandle

    from actors.runs.storage import Storage

from actors.plan import server_name
from actors.runs import credentials, runfiles
from actors.runs.storage import is_remote, open_storage
from core.display import notable
from core.schema import TERMINAL_STATES, ConfigError, JobConfig, JobStatus, NameTaken, OrchestratorError, parse
from orchestrator import local_runs
from orchestrator.config import default_run_root
from orchestrator.connection import (
    NAMESPACE,
    RayUnreachable,
    check_local_resources,
    connect,
    ensure_token_env,
    local_address,
)
from orchestrator.coordinator_handle import (
    Prior,
    find_coordinator,
    launch_coordinator,
    prior_job,
    remote_message,
    restarting,
    wait_actors_gone,
    wait_gone,
)
from orchestrator.results import MODEL_FILE, RunResult, rebuild_model
from orchestrator.run_storage import check_storage, job_root, job_storage, warn_local_storage

__all__ = [  # with the helpers callers import from here (the CLI, benchmarks, tests)
    "NAMESPACE", "POLL_S", "RESTART_WAIT_S", "ElasticJob", "check_local_resources", "check_storage", "connect",
    "ensure_token_env", "job_root", "job_storage",
]

log = logging.getLogger(__name__)
POLL_S = 0.2
RESTART_WAIT_S = 60.0
"""How long a call waits for a coordinator that Ray is restarting."""


class _Feed(TypedDict):
    """The coordinator's answer to a long poll (`watch_feed`), or the run folder's once it is gone."""

    events: list[dict]
    complete: bool
    step: int
    state: str


def _watch_feed(seen: int, after: int, wait_s: float) -> Callable[[Any], Any]:
    """The coordinator's `watch_feed` call for `ElasticJob._ask` (its arguments bound now, not at the loop's end)."""
    return lambda coordinator: coordinator.watch_feed.remote(seen, after, wait_s)


def scale_shortfall(count: int, status: JobStatus) -> str:
    """Why a scale to `count` has not reached it, in one line: each joiner still coming and what it waits for."""
    coming = [f"{m.slot} {m.state}" + (f" ({m.cause})" if m.cause else "") for m in status.members
              if m.state in ("starting", "ready")]
    spares = [f"hot spare {s['name']} {s['cause']}" for s in status.spares if s.get("cause")]
    gone = [f"{d.slot} {d.state}: {d.cause}" for d in status.departed[-1:]] if not coming else []
    return (f"scale to {count}: the job has {status.world_size} members now; "
            + "; ".join(coming + spares + gone or ["no joiner is starting"])
            + (" (a joiner that waits for room joins once Ray can place it; scaling again drops it)" if coming else ""))


class ElasticJob:
    def __init__(self, config: JobConfig, resume_from: str | None = None) -> None:
        """`resume_from`: a checkpoint file (see `actors.runs.checkpoints.newest_valid`)."""
        self.config = config
        self.policy_choice = ""
        """`sync.policy: auto`: what `start()` picked and why (the config then names the pick)."""
        self.resume_from = str(resume_from) if resume_from else None
        self.name = config.name
        self.run_id: str | None = None
        self.run_dir: Path | None = None
        self.storage: Storage | None = None
        self._coordinator: ActorHandle | None = None
        self._result: RunResult | None = None
        self.local_address: str | None = None
        """The GCS address of the local Ray this process started for the job (None on a cluster)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self, owned: bool = False) -> ElasticJob:
        """Start the job and return at once (the job runs in detached actors).

        `owned=True` (what `python -m orchestrator run` does without --detach) ties the job to this
        process: if it is killed, the coordinator stops the job cleanly with a checkpoint.
        """
        started_at = time.time()
        self.storage = storage = check_storage(self.config)  # before Ray starts
        if self.config.network.lab:  # the lab must be up as the config says (orchestrator/lab.py)
            from orchestrator.lab import require

            require(self.config.network)
        if self.config.sync.policy == "auto":  # the runtime model picks, on this job's workload and network
            from orchestrator.planner import choose, resumed_choice

            if self.resume_from:  # the checkpoint's state is the policy its run picked: keep that pick
                self.config, self.policy_choice = resumed_choice(
                    self.config, self.resume_from, (lambda loc: storage.read(storage.key_of(loc)))
                    if storage.remote else None)
            elif self.config.network.lab:  # the lab: its links as the config shapes them
                self.config, self.policy_choice, _ = choose(self.config)
        if connect(self.config):
            try:
                check_local_resources(self.config, ray.cluster_resources())
            except ConfigError:
                ray.shutdown()  # the local Ray this call started goes with the refusal
                raise
        self._take_name()
        if self.config.sync.policy == "auto":  # on the cluster itself: probes placed as the workers, measured there
            from actors.training.probe import probe_cluster
            from orchestrator.planner import choose

            self.config, self.policy_choice, _ = choose(self.config, cluster=probe_cluster(self.config.to_dict()))
        warn_local_storage(self.config)
        self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        self.run_dir = job_root(self.config) / self.run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_yaml = yaml.safe_dump(self.config.to_dict(), sort_keys=False).encode()
        runfiles.write_bytes_atomic(self.run_dir / "config.yaml", config_yaml)
        if storage.remote:
            storage.write(self._key("config.yaml"), config_yaml)
        self._coordinator = launch_coordinator(self.config, self.run_id, str(self.run_dir), self.resume_from,
                                               ray.get_runtime_context().get_job_id() if owned else None, started_at)
        ray.get(self._coordinator.start.remote())
        self._record_local(started_at)
        return self

    def _record_local(self, started_at: float) -> None:
        """On a local Ray this process started: record its address under the job's name, so that
        `status NAME` in another shell reaches it (`orchestrator/local_runs.py`); the address is dropped
        when this process, and that Ray with it, ends."""
        self.local_address = local_address()
        if self.local_address is None or self.run_dir is None:
            return
        pid = os.getpid()
        local_runs.record(local_runs.LocalRun(name=self.name, run_dir=str(self.run_dir), address=self.local_address,
                                              pid=pid, pid_started=local_runs.process_start(pid), started_at=started_at))
        atexit.register(local_runs.ended, self.name, pid)

    def _take_name(self) -> None:
        """Refuse to start under the name of a job that has not positively ended (a start never destroys
        another job's work); replace one that has."""
        old = find_coordinator(self.name)
        if old is None:
            return
        prior = prior_job(old)
        if prior.verdict is Prior.LIVE:
            raise NameTaken(f"a job named {self.name!r} is {prior.state}; stop it first "
                            f"(python -m orchestrator stop {self.name}) or choose another name")
        if prior.verdict is Prior.ENDED:
            ray.kill(old, no_restart=True)
        wait_gone(self.name, 10.0)

    @classmethod
    def attach(cls, name: str, address: str | None = None) -> ElasticJob:
        """Reach a job by name from any process; never starts a new Ray. With no address (none given, no
        RAY_ADDRESS, no connection yet), a job that started a local Ray on this machine is reached at that
        Ray while it lives (`orchestrator/local_runs.py`); once it has ended, its run folder answers
        (`status()`, `events()`, `history()`)."""
        if not (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized()):
            local = local_runs.lookup(name)
            if local is None or local.address is None:
                return cls._ended(name)
            try:
                connect(None, local.address, start_local=False)
            except RayUnreachable:  # its process lives on but has shut that Ray down (a notebook)
                return cls._ended(name)
        else:
            connect(None, address, start_local=False)
        coordinator = find_coordinator(name)
        record = runfiles.lookup_record(name)
        if coordinator is not None:
            status = JobStatus.from_dict(ray.get(coordinator.status.remote(), timeout=30))
            run_dir = Path(status.run_dir)
        elif record is not None:
            run_dir = Path(record["run_dir"])
        else:
            raise OrchestratorError(f"no job named {name!r} on this Ray cluster")
        if (run_dir / "config.yaml").exists():  # this node holds the run folder
            raw = yaml.safe_load((run_dir / "config.yaml").read_text())
        elif coordinator is not None:  # another node does: the coordinator has the config
            raw = ray.get(coordinator.config.remote(), timeout=30)
        elif record is not None and is_remote(record.get("storage")):  # the job ended; its runs are on shared storage
            storage = open_storage(record["storage"], record.get("storage_options") or {})
            raw = yaml.safe_load(storage.read(f"{name}/{run_dir.name}/config.yaml"))
        else:
            raise OrchestratorError(f"job {name!r} ended and its run folder {run_dir} is not on this node")
        if coordinator is not None:  # the storage keys the job was started with, while it runs (Ray's KV store)
            credentials.receive(runfiles.recall_secret(credentials.kv_key(name, run_dir.name)))
        return cls._reached(parse(JobConfig, raw), run_dir, coordinator)

    @classmethod
    def _ended(cls, name: str) -> ElasticJob:
        """A job of this machine's that no Ray holds any more, from its newest run folder (the one its
        local run recorded, or the run root's `<root>/<name>/<run id>`)."""
        run_dir = local_runs.run_folder(name)
        if run_dir is None:
            raise OrchestratorError(f"no job named {name!r}: no local run of it is recorded in {local_runs.records_dir()} "
                                    f"and it has no run folder under {default_run_root() / name}; for a job on a "
                                    f"cluster, pass --address or set RAY_ADDRESS")
        return cls._reached(parse(JobConfig, yaml.safe_load((run_dir / "config.yaml").read_text())), run_dir, None)

    @classmethod
    def _reached(cls, config: JobConfig, run_dir: Path, coordinator: ActorHandle | None) -> ElasticJob:
        job = cls(config)
        job._coordinator = coordinator
        job.run_dir = run_dir
        job.run_id = run_dir.name
        job.storage = job_storage(config) if is_remote(config.storage) else None
        return job

    def _ask(self, call: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """`call(coordinator)`, one of the coordinator actor's methods (`c.status.remote()`), waiting out
        a restart (Ray restarts it; it carries on). A call the dying process was answering is asked again
        of the new one: every call here is idempotent. Returns what the coordinator's method returns (a
        plain dict or list, as Ray carried it)."""
        coordinator = self._coordinator
        if coordinator is None:
            raise OrchestratorError(f"job {self.name!r} is not running")
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return ray.get(call(coordinator), timeout=timeout)
            except ray.exceptions.ActorUnavailableError:
                pass
            except ray.exceptions.RayActorError:
                if not restarting(coordinator):
                    raise
            if time.monotonic() > deadline:
                raise OrchestratorError(f"job {self.name!r}: its coordinator did not come back within {RESTART_WAIT_S:g}s")
            time.sleep(POLL_S)

    def status(self) -> JobStatus:
        if self._coordinator is not None:
            try:
                return JobStatus.from_dict(self._ask(lambda c: c.status.remote()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._coordinator = None
        data = runfiles.read_json(self.run_dir / "status.json") if self.run_dir else None
        storage = self._remote_storage()
        if data is None and storage is not None:
            try:
                data = json.loads(storage.read(self._key("status.json")))
            except (OSError, ValueError):
                data = None
        if data is None:
            raise OrchestratorError(f"job {self.name!r}: the coordinator is gone and left no final status in {self.run_dir}")
        return JobStatus.from_dict(data)

    def wait(self, timeout: float | None = None, on_status: Callable[[JobStatus], None] | None = None) -> RunResult:
        """Block until the job ends (or `timeout` seconds pass: TimeoutError)."""
        if self._result is not None:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            if on_status is not None:
                on_status(status)
            if status.state in TERMINAL_STATES:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name!r} still {status.state} after {timeout}s")
            time.sleep(POLL_S)
        self._result = RunResult(name=self.name, run_id=status.run_id, state=status.state, step=status.step,
                                 cause=status.cause, metrics=status.metrics, run_dir=status.run_dir,
                                 elapsed_s=(status.ended_at or time.time()) - status.started_at)
        self._release()
        return self._result

    def wait_for(self, what: str | Callable[[dict], bool] | None = None, timeout: float = 120.0, *,
                 step: int | None = None, since: int = 0, **detail: Any) -> dict:
        """Block until the job records a matching event, or its step reaches `step` (whichever comes
        first, when both are given); returns the event (with its number as `index`), or, for the step,
        the job's `step` and `state`.

        `what`: an event kind (`reshape`, `fault`, `transition`, `checkpoint`, `info`, ...) whose
        `detail` holds every `detail` keyword given (`wait_for("reshape", detector="replacement")`), or a
        predicate on an event's dict. Events are looked at from number `since` on (0: every event of the
        run; pass a returned `index + 1` to wait for a later one). The coordinator answers each call
        when something changed (a long poll), so a wait costs a few calls, not a poll every fraction
        of a second. Raises TimeoutError after `timeout` seconds, and OrchestratorError when the job
        ends first, each naming what it waited for."""
        if what is None and step is None:
            raise ValueError("wait_for: name an event kind, a predicate or a step")
        wanted = _describe_wait(what, step, detail)
        matches = _event_matcher(what, detail)
        deadline = time.monotonic() + timeout
        seen = since
        while True:
            remaining = deadline - time.monotonic()
            if self._coordinator is None:  # the job ended and was released: its events are in the run folder
                final = self.status()
                answer = _Feed(events=self.events()[seen:], complete=True, step=final.step, state=final.state)
            else:
                after, wait_s = _NO_STEP if step is None else step - 1, max(0.0, remaining)
                answer = self._ask(_watch_feed(seen, after, wait_s), timeout=wait_s + 30)
            events = answer["events"] if answer["complete"] else self.events()[seen:]
            if matches is not None:
                for index, event in enumerate(events, start=seen):
                    if matches(event):
                        return dict(event, index=index)
            seen += len(events)
            if step is not None and answer["step"] >= step:
                return {"step": answer["step"], "state": answer["state"]}
            if answer["state"] in TERMINAL_STATES:
                raise OrchestratorError(f"job {self.name!r} ended ({answer['state']}) before {wanted}")
            if remaining <= 0:
                raise TimeoutError(f"job {self.name!r}: no {wanted} within {timeout:g}s (step {answer['step']}, "
                                   f"{answer['state']})")

    def stop(self, reason: str = "stop requested", timeout: float = 60.0) -> JobStatus:
        """Graceful stop at the next committed step; returns once every actor of the job is gone."""
        if self._coordinator is not None:
            try:
                self._ask(lambda c: c.request_stop.remote(reason))
            except ray.exceptions.RayActorError:
                self._coordinator = None
        deadline = time.monotonic() + timeout
        while self._coordinator is not None and self.status().state not in TERMINAL_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name!r} did not stop within {timeout}s")
            time.sleep(POLL_S)
        status = self.status()
        self._release()
        if not ray.is_initialized():  # an ended job found from its run folder: no Ray, no actors
            return status
        names = [f"{self.name}/{status.run_id}/{m.slot}" for m in status.members]
        wait_actors_gone(names + ([server_name(self.name, status.run_id)] if status.server else []), timeout=30.0)
        return status

    def scale(self, count: int, wait: bool = True) -> JobStatus:
        """Grow or shrink the running job to `count` workers (within workers.min..max), restarting nobody.

        Joiners are made ready first (a ready hot spare at once; else the next spare to be ready, or a
        new actor) and admitted by one plan; members over the count leave by a plan, joiners not yet
        admitted being dropped first. The members switch at the next step the commit vote agrees on.
        With `wait` (the default), returns once the plan of `count` members is published; raises
        OrchestratorError, naming what is missing, where it is not (a joiner that Ray cannot place
        within `workers.pause_after_s`: it still joins once there is room, and scaling again drops it).
        Without, returns once the change is decided. A request nothing can act on raises ConfigError
        with the reason (a count outside [min, max], a stopping job, no free slot).
        """
        if self._coordinator is None:
            raise OrchestratorError(f"job {self.name!r} is not running")
        try:
            status = JobStatus.from_dict(self._ask(lambda c: c.scale.remote(int(count), wait), timeout=300))
        except ValueError as err:
            raise ConfigError(remote_message(err)) from None
        if wait and status.state in ("RUNNING", "RESHAPING", "PAUSED") and status.world_size != count:
            raise OrchestratorError(scale_shortfall(count, status))
        return status

    def _release(self) -> None:
        if self._coordinator is not None:
            try:
                ray.get(self._coordinator.release.remote(), timeout=10)
            except Exception as err:  # noqa: BLE001 - already gone
                log.debug("release: %s", str(err).splitlines()[0][:200])
            wait_gone(self.name, 10.0)
            self._coordinator = None

    # ------------------------------------------------------------------ results
    def history(self) -> list[dict]:
        return self._lines("history.jsonl")

    def events(self, kind: str | Iterable[str] | None = None) -> list[dict]:
        """The run's events, oldest first (events.jsonl): every one, or only those of `kind`, one kind or
        several (`events("reshape")`, `events(["reshape", "failure", "transition"])`)."""
        events = self._lines("events.jsonl")
        if kind is None:
            return events
        kinds = {kind} if isinstance(kind, str) else set(kind)
        return [event for event in events if event["kind"] in kinds]

    def _remote_storage(self) -> Storage | None:
        """The shared storage this run's files are mirrored to, if any."""
        if self.storage is not None and self.storage.remote and self.run_id is not None:
            return self.storage
        return None

    def _key(self, name: str) -> str:
        return f"{self.name}/{self.run_id}/{name}"

    def _lines(self, name: str) -> list[dict]:
        """A run file's records: this node's copy (the coordinator's, on one machine), else the
        storage's (the driver on another node, or this node's copy lost)."""
        if self.run_dir is None:
            return []
        storage = self._remote_storage()
        if (self.run_dir / name).exists() or storage is None:
            return runfiles.read_jsonl(self.run_dir / name)
        from actors.runs.mirror import read_appended

        return runfiles.parse_jsonl(read_appended(storage, self._key(name)))

    # ------------------------------------------------------------------ notebooks (orchestrator/notebook.py)
    def _view(self) -> tuple[JobStatus, tuple[dict, ...]]:
        return self.status(), notable(self.events())

    def _repr_html_(self) -> str:
        from core.display import status_html

        if self.run_dir is None:
            return f"<b>{self.name}</b> (not started: call <code>start()</code>)"
        status, events = self._view()
        return status_html(status, events, self.config.stop.max_steps)

    def watch(self, timeout: float | None = None, every: float = 1.0, block: bool = True):
        """Show the job until it ends: in a notebook one display kept up to date (a progress bar), else a
        progress line every `every` s. Blocks for at most `timeout` s; `block=False` watches from a
        background thread (returned) so that other cells run meanwhile. Does not release the job:
        `wait()` still returns its result."""
        from orchestrator import notebook

        if self.run_dir is None:
            raise OrchestratorError(f"job {self.name!r} has not started: call start() first")
        return notebook.watch(self._view, self.config.stop.max_steps, timeout, every, block)

    def model(self) -> torch.nn.Module:
        """The final model after `wait()` (for BSP, rank 0's replica, identical to the others; for the
        server policies, the parameter server's), rebuilt from the factory (orchestrator/results.py)."""
        path = self.run_dir / MODEL_FILE if self.run_dir else None
        storage = self._remote_storage()
        if path is not None and path.exists():
            blob = path.read_bytes()
        elif path is not None and storage is not None and storage.size(self._key(MODEL_FILE)) is not None:
            blob = storage.read(self._key(MODEL_FILE))
        else:
            raise OrchestratorError(f"job {self.name!r} has no final model yet (state {self.status().state})")
        return rebuild_model(self.config, blob)

    def model_location(self) -> str | None:
        """Where the final model (`model.pt`) is: this node's run folder, else the run's storage (its
        URI); None before the job has ended with one."""
        path = self.run_dir / MODEL_FILE if self.run_dir else None
        if path is not None and path.exists():
            return str(path)
        storage = self._remote_storage()
        if storage is not None and storage.size(self._key(MODEL_FILE)) is not None:
            return storage.location(self._key(MODEL_FILE))
        return None


_NO_STEP = 2**62
"""A step no job reaches: the long poll then wakes on events only."""


def _event_matcher(what: str | Callable[[dict], bool] | None, detail: dict) -> Callable[[dict], bool] | None:
    if what is None:
        return None
    if callable(what):
        return what
    return lambda e: e.get("kind") == what and all(e.get("detail", {}).get(k) == v for k, v in detail.items())


def _describe_wait(what: str | Callable[[dict], bool] | None, step: int | None, detail: dict) -> str:
    if what is None:
        return f"step {step}"
    if callable(what):
        return f"an event for which {getattr(what, '__name__', 'the predicate')} holds"
    where = ", ".join(f"{k}={v!r}" for k, v in detail.items())
    return f"a {what!r} event" + (f" with {where}" if where else "")
