"""What a replica's step, its epoch entry and the moves between its committed states need of it
(`Replica` in actors/training/replica.py provides it): its parts, which each own their state, and the few
calls through which they change the replica's own fields (its plan, its phase, its cause).

The parts are read through the replica at each use, not held: a policy switch replaces its binding whole.
"""
from __future__ import annotations

from typing import Any, Protocol

from actors.faults import WorkerFaults
from actors.plan import Plan, PlanBook, WorkerSpec
from actors.training.batch_feed import BatchFeed
from actors.training.epoch_group import EpochGroup
from actors.training.policy_binding import PolicyBinding
from actors.training.reporter import Link, StepReporter
from actors.training.samples import SampleLedger
from actors.training.step_metrics import StepMetrics
from actors.training.training_state import TrainingState


class ReplicaParts(Protocol):
    slot: str
    spec: WorkerSpec
    link: Link
    workload: Any
    training: TrainingState
    policy: PolicyBinding
    feed: BatchFeed
    group: EpochGroup
    reporter: StepReporter
    samples: SampleLedger
    metrics: StepMetrics
    faults: WorkerFaults
    plans: PlanBook
    plan: Plan | None
    trained_plan: Plan | None
    """The plan under which the provisional steps since the last commit were trained."""

    @property
    def device(self) -> Any: ...
    @property
    def committed(self) -> Any:
        """The moves between committed states (actors/training/committed.py `CommittedState`)."""
    def mark(self) -> int: ...
    def newest_plan(self) -> Plan: ...
    def enter_phase(self, phase: str) -> None: ...
    def gradients_at(self, reset: bool = False) -> float | None: ...
    def joining(self) -> None: ...
    def failed_with(self, cause: str) -> None: ...
    def adopt(self, plan: Plan) -> None: ...
    def trained_under(self, plan: Plan) -> None: ...
    def switch_policy(self, sync: dict, compression: dict) -> None: ...
    @property
    def shards(self) -> Any:
        """Its shards of the replica (actors/training/sharded_replica.py `ReplicaShards`), None without replica groups."""
    def train_shards(self, model: Any, optimizer: Any) -> None: ...
