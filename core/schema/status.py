"""What a job reports back: its state, members, events, status and result (the driver, the actors and
the CLI share these)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

JobState = Literal["STARTING", "RUNNING", "RESHAPING", "PAUSED", "STOPPING", "STOPPED", "FINISHED", "FAILED"]
TERMINAL_STATES = ("STOPPED", "FINISHED", "FAILED")


@dataclass(frozen=True)
class MemberStatus:
    slot: str
    rank: int
    node: str
    pid: int
    state: str
    """starting / ready / training / leaving / left / finished / dead / failed / hung / retired / stopped"""
    actor_id: str = ""
    cause: str = ""
    """Why it is hung, failed or retired; while it starts, what it waits for (a hot spare, room in the cluster)."""
    node_id: str = ""


@dataclass(frozen=True)
class Event:
    """A coordinator state transition or a reshape, with its reason."""

    time: float
    kind: str
    """transition / reshape / failure / checkpoint / straggler / fault / unplaced / info"""
    reason: str
    state_from: str | None = None
    state_to: str | None = None
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class JobStatus:
    name: str
    run_id: str
    state: str
    step: int
    membership_epoch: int
    world_size: int
    members: tuple[MemberStatus, ...]
    loss: float | None
    throughput: float | None
    """Committed steps per second over the last few seconds."""
    cause: str | None
    run_dir: str
    metrics: dict = field(default_factory=dict)
    """The newest evaluation's metrics (`evaluate`), by name."""
    step_metrics: dict = field(default_factory=dict)
    """The step metrics the workload's loss returns beside the loss, as the newest committed step recorded
    them (docs/workloads.md says how they are aggregated over the members), by name."""
    reshapes: tuple[Event, ...] = ()
    departed: tuple[MemberStatus, ...] = ()
    """Earlier incarnations that died, hung, failed or were retired, with their causes (newest last)."""
    incarnation: int = 0
    """How often the coordinator has been restarted (it carries on each time)."""
    coordinator_pid: int = 0
    started_at: float = 0.0
    """When the job started (its coordinator was created), as a Unix time."""
    ended_at: float | None = None
    """When it reached STOPPED, FINISHED or FAILED."""
    stragglers: dict = field(default_factory=dict)
    """Training members whose step time is above 1.5x the median, with that ratio (slot -> ratio)."""
    server: dict = field(default_factory=dict)
    """Server policies: the parameter server's version, incarnation, restarts, staleness histogram
    (updates by staleness), refused pushes by reason and lease counts (samples leased, applied,
    dropped, requeued, outstanding)."""
    topology: dict = field(default_factory=dict)
    """Gossip policies: the topology's kind, the world size it is built for, and its spectral gap there
    (1 - rho^(1/period), algorithms/rules/topologies.py)."""
    tokens_per_s: float | None = None
    """Tokens per second of wall clock over the newest records (the last 5 s, at least the last 4
    records), all members together: workloads that count tokens (`tokens_per_sample`, the language
    models); None for the others."""
    mfu: float | None = None
    """The newest committed step's model FLOPs utilization: one worker's tokens over its compute time, times
    the workload's FLOPs per token, over the device's dense peak (known GPUs, or `ORCHESTRATOR_PEAK_FLOPS`)."""
    worker_tokens_per_compute_s: float | None = None
    """One worker's tokens per second of its own compute (steps less their waits on the others), over the
    same records: beside `tokens_per_s / world_size`, what waiting costs."""
    spares: tuple[dict, ...] = ()
    """Hot spares (`workers.spares`): name, state (starting or ready), pid, node and started_at (time.time())
    of each."""
    checkpoint: dict = field(default_factory=dict)
    """The last durable checkpoint of this run: `step`, `time` (time.time()) and `path` (its data file, or
    its URI on remote storage) once one is stored, and
    `failures`, the tries to store one that failed (each a `checkpoint_failed` event); empty before any."""
    samples_skipped: int = 0
    """Bad training samples skipped so far (`workload.on_bad_sample: skip`; each a `samples_skipped` event)."""
    tensor_bytes: dict = field(default_factory=dict)
    """With replica groups (`sharding.group_size` > 1): what rank 0 holds of the training state at the current
    membership epoch's start, in bytes: its shard's `parameters`, `gradients` and `optimizer` state, its copy of
    its neighbour's shard (`mirror`) and their `total`; empty without replica groups."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _repr_html_(self) -> str:
        """Jupyter's view (core/display.py)."""
        from core.display import status_html

        return status_html(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobStatus:
        data = dict(data)
        data["members"] = tuple(MemberStatus(**m) for m in data.get("members", ()))
        data["reshapes"] = tuple(Event(**e) for e in data.get("reshapes", ()))
        data["departed"] = tuple(MemberStatus(**m) for m in data.get("departed", ()))
        return cls(**data)


@dataclass(frozen=True)
class JobResult:
    name: str
    run_id: str
    state: str
    step: int
    cause: str | None
    metrics: dict
    run_dir: str
    elapsed_s: float
    """The job's run time: from its start to its end (not to when `wait()` returned)."""

    @property
    def ok(self) -> bool:
        return self.state == "FINISHED"
