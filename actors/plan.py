"""Small frozen dataclasses that cross actor boundaries: plans, worker specs, reports.

Also `exit_if_orphaned`: Ray's actor processes live in process groups of their own, so when
the raylet that started them is killed they can run on for seconds; an actor that finds its
parent gone exits at once rather than keep training or writing checkpoints for a dead job.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


def server_name(job: str, run_id: str) -> str:
    """The Ray actor name of a job's parameter server (or lease dispenser)."""
    return f"{job}/{run_id}/server"


def holder_name(job: str, run_id: str) -> str:
    """The Ray actor name of a run's Ray Data holder (actors/training/data_holder.py)."""
    return f"{job}/{run_id}/data"


@dataclass(frozen=True)
class Plan:
    """What every member runs from the step at which the commit vote adopts it."""

    version: int
    """Increases with every publication (membership change, stop request, ...)."""
    membership_epoch: int
    members: tuple[str, ...]
    """Slots in rank order."""
    group_name: str
    store_host: str
    store_port: int
    timeout_s: float
    global_batch: int
    backend: str = "gloo"
    lr_scale: float = 1.0
    """Multiplies the learning rate (linear scaling in `keep_worker` batch mode)."""
    formation_timeout_s: float | None = None
    """`comm.formation_timeout_s`: how long the epoch's group may take to form (None: `timeout_s`)."""
    stop_step: int | None = None
    """Members stop once this committed step is reached (target metric, time limit, stop)."""
    history_step: int = 0
    """The newest step in the job's history when the plan was published: at the epoch agreement,
    rank 0 sends the coordinator the records it keeps after this step (see actors/control/ledger.py)."""
    reason: str = ""
    nodes: tuple[str, ...] = ()
    """Where each member runs, in rank order (the lab's virtual node, else its Ray node; "" unknown):
    what hierarchical all-reduce groups by."""
    policy: dict | None = None
    """The policy the members run when the coordinator switched it mid-run (the online trial of
    `sync.auto`): `{label, sync, compression, fresh}`; None: the config's. `fresh`: the switch has not
    committed a step yet, so the epoch's members all take rank 0's state once they have entered (a
    periodic policy's inner optimizer state is each member's own)."""
    aborts_epoch: int | None = None
    """The membership epoch this plan's receipt aborts (its collectives fail at once, as `abort_epoch`
    does), or None. The survivors' plan after a death carries the abort of the epoch the death ended:
    one call to each member, not an abort and then a plan. Not part of the book's plan: only the
    copy sent carries it."""

    def rank_of(self, slot: str) -> int | None:
        return self.members.index(slot) if slot in self.members else None


class PlanBook:
    """The plans a worker has received, newest first, and the waits on them.

    Plans arrive on the control channel (any thread); the training thread waits here. `tick` runs
    every half second while waiting (the orphan check)."""

    def __init__(self, tick: Callable[[], None] = lambda: None) -> None:
        self.plans: dict[int, Plan] = {}
        """Only the newest plan is kept: a vote agrees on the maximum of the members' newest versions,
        so no older one is ever asked for (the plan a worker trains under is its own copy)."""
        self.named: set[str] = set()
        """Every slot any plan so far named (admission asks; bounded by the job's slots)."""
        self.latest: Plan | None = None
        self._cv = threading.Condition()
        self._tick = tick

    def add(self, plan: Plan) -> None:
        with self._cv:
            self.named.update(plan.members)
            if self.latest is None or plan.version > self.latest.version:
                self.latest = plan
                self.plans = {plan.version: plan}
            self._cv.notify_all()

    def _wait(self, done: Callable[[], bool]) -> None:
        with self._cv:
            while not done():
                self._cv.wait(0.5)
                self._tick()

    def admission(self, slot: str) -> Plan:
        """The newest plan once some plan names `slot`: the plan that admits a worker and its `run()`
        travel on different channels, so `run()` may start first (a later plan may drop it again)."""
        self._wait(lambda: slot in self.named)
        return self._newest()

    def newer_than(self, version: int) -> Plan:
        self._wait(lambda: self.latest is not None and self.latest.version > version)
        return self._newest()

    def _newest(self) -> Plan:
        """The newest plan, once a wait saw one arrive."""
        if self.latest is None:
            raise RuntimeError("no plan has arrived yet")
        return self.latest

    def agreed(self, version: int) -> Plan | None:
        """The plan the members' vote agreed on. Every member is sent every plan, so one not received
        yet is on its way: wait for it (the coordinator may be restarting, so never ask it). None when
        a still newer plan arrives first: that one supersedes it."""
        self._wait(lambda: version in self.plans or self._newest().version > version)
        return self.plans.get(version)


@dataclass(frozen=True)
class WorkerSpec:
    job: str
    run_id: str
    slot: str
    run_dir: str
    coordinator: str
    namespace: str
    config: dict = field(default_factory=dict)
    search_path: tuple[str, ...] = ()
    """The driver's working directory: user workload modules are imported from there."""
    incarnation: int = 0
    """Which start of this slot this is (the coordinator counts them): a parameter server refuses the
    pushes of a replaced incarnation."""
    secret: bytes = field(default=b"", repr=False)
    """The job's rendezvous key (travels only over Ray): every value a member writes to the group store
    is signed with it, and one without a valid signature is refused (actors/transport/comm.py `SignedStore`)."""


@dataclass(frozen=True)
class Progress:
    """A worker's batched report: its step now, and (rank 0) the history records since last time."""

    slot: str
    step: int
    membership_epoch: int
    time: float
    records: tuple[dict, ...] = ()
    compute_s: float = 0.0
    """EWMA of this worker's compute time per step (forward + backward), for `scale_down: slowest`."""
    step_s: tuple[float, ...] = ()
    """The compute time of each step since the previous report (the job's step-time histogram)."""
    mark: int = 0
    """The step of its newest committed state (the last round, for periodic policies)."""


def worker_tokens(record: dict) -> float:
    """One worker's tokens in a history record: a member's own record (per-member kinds: it names its
    slot) holds its own; rank 0's holds the global batch's, shared by `world_size` members."""
    return record["tokens"] / (1 if "slot" in record else max(int(record.get("world_size") or 1), 1))


class ParentWatch:
    """Remembers the parent (the raylet) at start; `exit_if_orphaned` leaves once it is gone."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def exit_if_orphaned(self) -> None:
        if os.getppid() != self.parent:
            os._exit(1)


def turn_steps(candidate: dict, steps: int) -> int:
    """A candidate of `sync.auto`'s online trial (a `policy_trial` entry, with its `sync:` section) runs
    `steps` steps in its turn, rounded up to whole rounds where it synchronizes every h steps: the turn's
    step time then carries its share of each round. The coordinator's trial and the members (who report
    a turn's last step at once) read it alike."""
    h = candidate.get("sync", {}).get("h", 1)
    h = h if isinstance(h, int) and h > 1 else 1
    return -(-max(int(steps), 1) // h) * h
