"""What a replica is made of, and what each of its phases reads: its config, device, model,
optimizer, synchronization policy, data source, plans, and the fields of its step and commit
mark; and the `Link` through which it reaches its coordinator.

`ReplicaBase` builds them; the phases are mixins over it (actors/training/replica_state.py,
actors/training/replica_epochs.py, actors/training/replica_feed.py, actors/training/replica_reports.py) and
`Replica` (actors/training/replica.py) runs the loop.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from actors.faults import WorkerFaults
from actors.plan import Plan, PlanBook, Progress, WorkerSpec
from actors.runs import runfiles
from actors.training.loader import BatchLoader, ProcessFetcher
from actors.training.sources import source_for
from actors.training.workload import build_workload, device_for, ray_blocks
from actors.transport.comm import BaseCommunicator, Handle
from algorithms.policies.base import get_algorithm
from algorithms.policies.optim import build_optimizer
from core.schema import JobConfig, WorkloadRefused, parse

log = logging.getLogger(__name__)
KEEP_RECORDS = 2048
"""Records each member keeps of its newest commit points, for the coordinator to catch up from
(a departed rank 0's unreported steps, a restarted coordinator's gap)."""


class Link(Protocol):
    """How a replica reaches its coordinator (every call may be lost; none may block training long)."""

    def report(self, progress: Progress, wait: bool) -> None: ...
    def epoch_agreed(self, epoch: int, step: int, records: tuple[dict, ...]) -> None: ...
    def state_received(self, slot: str, epoch: int, source: str, step: int) -> None: ...
    def collective_failed(self, slot: str, epoch: int, error: str) -> None: ...
    def fault_fired(self, index: int, slot: str, step: int, phase: str) -> None: ...
    def samples_skipped(self, slot: str, step: int, ids: list[int], reason: str) -> None: ...
    def transport_fallback(self, slot: str, epoch: int, group: str, reason: str) -> None: ...
    def save_checkpoint(self, step: int, blob: bytes) -> None: ...
    def checkpoints_stored(self, timeout: float) -> None:
        """Returns once the checkpoints sent so far are stored (or raises, or `timeout` passed)."""


@runtime_checkable
class Closing(Protocol):
    """A group with connections of its own to close (every backend's; `BaseCommunicator` does not declare it)."""

    def close(self) -> None: ...


@runtime_checkable
class Reducing(Protocol):
    """A group that reduces (every backend's; `NoGroup`, of the kinds without one, does not)."""

    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle: ...


def close_group(comm: BaseCommunicator) -> None:
    """Close a membership epoch's group."""
    if isinstance(comm, Closing):
        comm.close()


class ReplicaBase:
    """A replica's parts and fields (`Replica` in actors/training/replica.py is the whole)."""

    def __init__(self, spec: WorkerSpec, link: Link, node_ip: str, tick: Callable[[], None] = lambda: None,
                 kill_actor: Callable[[], None] = lambda: None, workload: Any = None) -> None:
        """`tick` runs while the replica waits (the orphan check); `kill_actor` for `how: actor_kill` faults;
        `workload`: one `build_workload` made earlier (a hot spare's), else it is built here."""
        self.spec, self.slot, self.link, self.node_ip, self._tick = spec, spec.slot, link, node_ip, tick
        self.cfg: JobConfig = parse(JobConfig, spec.config)
        self.comm_address = node_ip
        """Where this member's group traffic leaves from: the node's address, or in the lab its virtual
        node's (orchestrator/lab.py; the preloaded shim binds its connections there too)."""
        network = self.cfg.network
        if network.lab and not spec.slot.startswith("spare"):
            self.comm_address = network.address(network.node_of(spec.slot))
            os.environ["ORCHESTRATOR_LAB_SOURCE"] = self.comm_address
        torch.set_num_threads(max(1, int(self.cfg.workers.cpus)))
        self.device = device_for(self.cfg.workers.gpus)
        self.workload = workload if workload is not None else build_workload(self.cfg)
        self.model: torch.nn.Module = self.workload.model.to(self.device)
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optimizer)
        self.algorithm = get_algorithm(self.cfg.sync.policy)(self.cfg.sync, self.cfg.compression)
        self.impl = self.algorithm.bind(self.model, self.optimizer)
        self.impl.on_gradients_ready = self._gradients_ready
        self.metric_names: tuple[str, ...] = ()
        """The names of the step metrics the workload's loss returns (sorted; `split_loss`): what the
        vote carries after the loss, and history records as `step_metrics`. Travels in the state."""
        self._metrics_settled = False
        """This process has trained a step: the metrics' names can no longer change."""
        self._gradients_at: float | None = None
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.source = source_for(self.workload.train_data, self.cfg.seed, self.cfg.workload.on_bad_sample,
                                 functools.partial(ray_blocks, spec), self.algorithm.kind)
        self.skips_bad = self.cfg.workload.on_bad_sample == "skip"
        self.skipped_now = 0
        """Samples of the newest step's global batch that no member could read (a synchronous kind that
        skips bad samples counts them over the group): its history record says how many."""
        loader = self.cfg.workload.loader
        self._loader = BatchLoader(loader.workers, loader.prefetch) if loader.workers > 0 else None
        self._fetcher: ProcessFetcher | None = None
        if loader.workers > 0 and loader.processes:
            if self.source.kind not in ("map-style", "datasets"):
                raise WorkloadRefused(f"workload.loader.processes reads map-style or Hugging Face data by id; this "
                                      f"train_data is a {self.source.kind} source (use loader threads)")
            self._fetcher = ProcessFetcher(loader.workers, spec.config)
        self._copy_stream: Any = None
        """The loader's CUDA stream for its copies to the device (created at its first batch on a GPU)."""
        self.tokens_per_sample = int(getattr(self.workload, "tokens_per_sample", None) or 0)
        self.step = self.cursor = 0
        self.holds_state = False
        """It trained a step or loaded a state (entry `average`: a member that never did receives one)."""
        self.mark_cursor = 0
        """The data cursor at the newest commit point."""
        self._slot_index = int(self.slot[1:])
        self.plans = PlanBook(tick)
        self.plan: Plan | None = None
        self.trained_plan: Plan | None = None
        """The plan under which the provisional steps since the last commit were trained."""
        self._dropped_slots: set[str] = set()
        """Departed members whose shares of those steps were already counted as dropped."""
        self._settle_due = False
        """The epoch's group has committed no step yet: its first commit settles it (`comm.settled`)."""
        self.comm: BaseCommunicator | None = None
        self.state, self.cause = "ready", ""
        self.phase, self.phase_since = "starting", time.monotonic()
        self.exit_if_stuck: Callable[[str], None] | None = None
        """Set by the worker actor: ends this process when a step outlives its group's abort (`watch_release`);
        None in process (replicas in threads of a test), where the group's timeout ends such a step."""
        self._finished = threading.Event()
        self._left = False
        self._eval_model: torch.nn.Module | None = None
        self._waited = 0.0
        """Seconds the newest step waited on others: for its samples, the policy's lock, its collectives."""
        self._outcome: dict = {}
        self._records: list[dict] = []
        self._agreement: tuple[int, int, tuple[dict, ...]] | None = None
        """Rank 0's epoch agreement (epoch, agreed step, records after the plan's history step), sent
        ahead of its next report (`_flush_report`): after the epoch's first commit, off the re-form's path."""
        self.kept: deque[dict] = deque(maxlen=KEEP_RECORDS)
        """History records of this replica's newest commit points (every member keeps them)."""
        self._last_report = 0.0
        self._turn: tuple[str, int, bool] | None = None
        """`sync.auto`'s trial: (the policy's label, the first step it committed, whether its turn's last
        step was reported at once)."""
        self.compute_s = 0.0
        self._step_s: list[float] = []
        self.bytes_before = 0
        """Bytes this member sent in earlier membership epochs (each epoch's communicator counts its own)."""
        self.dropped = 0
        """Samples handed to departed members since the last record and counted as dropped."""
        self.max_steps = self.cfg.stop.max_steps if self.algorithm.counts_steps else None
        self.faults = WorkerFaults(self.cfg.faults, self.slot, link.fault_fired, kill_actor)
        self._pending_ids: list[tuple[int, np.ndarray]] = []
        self._samples = None
        if self.cfg.faults.record_samples and self.algorithm.reporter != "server":  # the server writes what it applies
            os.makedirs(os.path.join(spec.run_dir, "samples"), exist_ok=True)
            self._samples = runfiles.open_appended(os.path.join(spec.run_dir, "samples", f"{self.slot}.txt"))

    def _set_metric_names(self, names: tuple[str, ...]) -> None:
        """The step metrics' names (the width of every vote from the next on_membership, or refit now)."""
        self.metric_names = names
        self.impl.vote_extras = len(names)

    def _mark(self) -> int:
        """The step of the newest committed state (the current step, unless periodic local steps are
        provisional)."""
        mark = self.impl.commit_mark
        return self.step if mark is None else mark

    def _plan_now(self) -> Plan:
        """The plan this replica runs under (it has one from its admission on)."""
        if self.plan is None:
            raise RuntimeError(f"{self.slot} has not been admitted to a plan")
        return self.plan

    def _rank_in(self, plan: Plan) -> int:
        """This member's rank in `plan`, which names it."""
        rank = plan.rank_of(self.slot)
        if rank is None:
            raise RuntimeError(f"{self.slot} is not a member of plan {plan.version}")
        return rank

    def _newest_plan(self) -> Plan:
        """The newest plan received (a replica runs only once it has its first)."""
        latest = self.plans.latest
        if latest is None:
            raise RuntimeError(f"{self.slot} has received no plan")
        return latest

    def _enter_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def _gradients_ready(self) -> None:
        """This member's gradients are computed; its backward now waits for the sums (the reducer)."""
        self._gradients_at = time.perf_counter()
        self._enter_phase("communicate")

