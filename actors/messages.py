"""What a worker answers its coordinator, as typed messages across the process boundary: its answer when
it is ready (or adopted), its heartbeat, its status and the outcome of its run. Plans and progress
reports travel the other way and up as `Plan` and `Progress` (actors/plan.py).

Each is a frozen dataclass that Ray pickles as it is: the coordinator reads its fields by name, checked by
mypy at both ends (the worker actor, the `WorkerGroup` seam in actors/control/workers.py and its fake).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.plan import Plan
from algorithms.rules.supervision import DataFault, WorkloadFault


@dataclass(frozen=True)
class ReadyAnswer:
    """A worker (or a hot spare) that has built its workload and serves its group store."""

    slot: str
    pid: int
    node: str
    """The node's address."""
    node_id: str = ""
    store_port: int = 0
    """The port of the group store this worker serves (`HostedStore`), for the plans whose rank 0 it is."""
    lifeline: Any = None
    """How the coordinator learns of this process's death at once (actors/lifeline.py), if it can."""
    checksum: int | None = None
    """Of its initial model's parameters (None for a spare, which holds no replica)."""
    batch_norm: bool = False
    """Its model has BatchNorm layers (a share of one sample would fail their training)."""


@dataclass(frozen=True)
class Heartbeat:
    """Cheap liveness and progress: what the run thread is doing and for how long."""

    step: int
    phase: str
    phase_age_s: float


@dataclass(frozen=True)
class WorkerStatus:
    """A worker's committed state and where it stands (a restarted coordinator's re-attachment, the end of a run)."""

    slot: str
    pid: int
    step: int
    """The step of its newest committed state."""
    checksum: int
    state: str
    holds_state: bool
    rank: int
    membership_epoch: int
    plan: Plan | None
    """The newest plan it received."""
    store_port: int = 0


@dataclass(frozen=True)
class RunOutcome:
    """How a worker's run ended (what `watch` returns)."""

    ok: bool
    step: int = 0
    slot: str = ""
    holds_state: bool | None = None
    """Whether it holds a committed state at its end (None where the run failed)."""
    error: str = ""
    traceback: str = ""
    data_fault: DataFault | None = None
    """A bad training sample ended it (the data's error, not this worker's)."""
    workload_fault: WorkloadFault | None = None
    """The workload's own code raised (its error names the user's file and line)."""
