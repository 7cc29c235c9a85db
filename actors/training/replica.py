"""One training replica: the step loop and the calls its worker actor makes. No Ray here.

A replica owns a *slot* (a stable id such as `w3`); its rank changes with every membership epoch.
`run()` trains until the plan says stop. It talks to its coordinator only through a `Link` (the
Ray actor in actors/training/worker.py provides one over Ray; tests run replicas in threads with an
in-process one), and its synchronization policy only through the seam of algorithms/policies/base.py:

    each step      forward and backward (the policy's hooks launch communication), then the
                   policy's vote: a step whose vote fails is not applied; one that passes is
                   applied and, when it is a commit point, becomes the committed state
    each round     periodic policies: `sync` is the round and its vote, the commit point of the
                   local steps before it (which stay provisional until then)
    each epoch     a new group is formed and entered (actors/training/entry.py): the members agree on the
                   newest committed state before training on

Every committed state is marked (step, data cursor); history records, checkpoints, the final model
and the state a joiner receives are all taken at a commit point. Data: every member computes each
step's global batch from (seed, cursor) and trains its rank's share, so within a data epoch no
sample is applied twice across any number of reshapes; a departed member's shares of periodic
local steps that the survivors keep are counted as dropped.

The replica is composed of objects that each own their state: `TrainingState` (model, optimizer, step,
cursor, commit mark; actors/training/training_state.py), `PolicyBinding` (the policy running, replaced whole
at a switch), `BatchFeed` (the data), `EpochGroup` (the communicator), `StepReporter` (records, reports,
checkpoints), `SampleLedger` (samples applied and dropped) and `StepMetrics`. The step itself is
actors/training/step.py's `StepRunner`.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch

from actors.faults import WorkerFaults
from actors.messages import Heartbeat, ReadyAnswer, RunOutcome, WorkerStatus
from actors.plan import Plan, PlanBook, WorkerSpec
from actors.training.batch_feed import BatchFeed
from actors.training.committed import CommittedState
from actors.training.epoch_entry import EpochEntry
from actors.training.epoch_group import EpochGroup
from actors.training.policy_binding import PolicyBinding
from actors.training.reporter import Link, StepReporter
from actors.training.samples import SampleLedger
from actors.training.sources import BadSample, source_for
from actors.training.step import StepRunner
from actors.training.step_metrics import StepMetrics
from actors.training.training_state import TrainingState, checksum, read_state
from actors.training.user_code import WorkloadBug, metrics_of
from actors.training.workload import build_workload, device_for, ray_blocks
from actors.transport.comm import BaseCommunicator
from algorithms.policies.base import EpochInfo
from algorithms.policies.optim import build_optimizer
from algorithms.policies.precision import Precision, guarded
from algorithms.policies.sharded import Sharded
from core.schema import JobConfig, parse

if TYPE_CHECKING:
    from actors.training.sharded_replica import ReplicaShards

log = logging.getLogger(__name__)


@runtime_checkable
class ServerBound(Protocol):
    """A server kind's policy: it pulls from a server that fences it by (slot, worker incarnation)."""

    def connect(self, client: Any, slot: str, incarnation: int) -> None: ...


@runtime_checkable
class Backgrounded(Protocol):
    """The background kind's policy: it forms its own group per epoch, off the foreground."""

    def attach(self, make_group: Callable[[EpochInfo], BaseCommunicator | None], save_state: Callable[[], bytes],
               load_state: Callable[[bytes], None], on_failure: Callable[[str], None],
               on_state: Callable[[str, int], None]) -> None: ...


class Replica:
    """The parts of one member, the calls its worker actor makes (any thread) and the run loop."""

    def __init__(self, spec: WorkerSpec, link: Link, node_ip: str, tick: Callable[[], None] = lambda: None,
                 kill_actor: Callable[[], None] = lambda: None, server: Any = None, workload: Any = None,
                 exit_if_stuck: Callable[[str], None] | None = None, device_index: int = 0) -> None:
        """`tick` runs while the replica waits (the orphan check); `kill_actor` for `how: actor_kill` faults;
        `device_index`: its GPU where it asked for one (0 in a worker, where Ray shows it only its own;
        replicas in threads of one process each take one);
        `server`: the parameter server's client (algorithms/policies/server_policies.py), for server kinds;
        `workload`: one `build_workload` made earlier (a hot spare's), else it is built here;
        `exit_if_stuck`: ends this process when a step outlives its group's abort (`watch_release`), from the
        worker actor; None in process (replicas in threads of a test), where the group's timeout ends such a step."""
        self.spec, self.slot, self.link, self.node_ip = spec, spec.slot, link, node_ip
        cfg: JobConfig = parse(JobConfig, spec.config)
        comm_address = node_ip
        if cfg.network.lab and not spec.slot.startswith("spare"):  # the lab's virtual node (orchestrator/lab.py)
            comm_address = cfg.network.address(cfg.network.node_of(spec.slot))
            os.environ["ORCHESTRATOR_LAB_SOURCE"] = comm_address  # the preloaded shim binds its connections there
        torch.set_num_threads(max(1, int(cfg.workers.cpus)))
        self.device = device_for(cfg.workers.gpus, device_index)
        self.workload = workload if workload is not None else build_workload(cfg)
        model: torch.nn.Module = self.workload.model.to(self.device)
        model.train()
        precision = Precision(cfg.training.precision, self.device.type)
        self.training = TrainingState(model, guarded(build_optimizer(model, cfg.optimizer), cfg.optimizer.clip_grad_norm,
                                                     precision), precision)
        self.shards = replica_shards(cfg, model)
        """Its shards of the replica, with replica groups (`sharding.group_size` > 1); None: it holds it whole."""
        self._gradients_at: float | None = None
        self.policy = self._bind(cfg)
        self.metrics = StepMetrics(self._resize_vote)
        self.feed = BatchFeed(source_for(self.workload.train_data, cfg.seed, cfg.workload.on_bad_sample,
                                         functools.partial(ray_blocks, spec), self.policy.algorithm.kind,
                                         getattr(self.workload, "collate_fn", None)),
                              cfg, self.slot, self.device, spec.config)
        self.faults = WorkerFaults(cfg.faults, self.slot, link.fault_fired, kill_actor)
        self.group = EpochGroup(cfg, comm_address, lambda epoch, group, reason: link.transport_fallback(
            self.slot, epoch, group, reason))
        self.reporter = StepReporter(cfg, self.slot, link, self.workload, self.faults, self.device,
                                     int(getattr(self.workload, "tokens_per_sample", None) or 0),
                                     precision.compute_dtype(next(model.parameters()).dtype))
        # the server writes what it applies
        self.samples = SampleLedger(spec.run_dir, self.slot,
                                    cfg.faults.record_samples and not self.policy.algorithm.reporter.server_reports)
        self.plans = PlanBook(tick)
        self.plan: Plan | None = None
        self.trained_plan: Plan | None = None
        """The plan under which the provisional steps since the last commit were trained."""
        self.state, self.cause = "ready", ""
        self.phase, self.phase_since = "starting", time.monotonic()
        self._exit_if_stuck = exit_if_stuck
        self._finished = threading.Event()
        self._left = False
        self._outcome = RunOutcome(False, 0, self.slot, error="the run has not ended")
        self._steps = StepRunner(self, tick)
        self._entry = EpochEntry(self)
        self.committed = CommittedState(self)
        impl = self.policy.impl
        if server is not None and self.policy.algorithm.kind.runs_server and isinstance(impl, ServerBound):
            impl.connect(server, self.slot, spec.incarnation)  # fenced by (slot, worker incarnation)
        if self.policy.algorithm.kind.background_rounds and isinstance(impl, Backgrounded):  # its own group per epoch
            impl.attach(lambda epoch: self.group.background_group(self.plan, epoch.membership_epoch), self.committed.state_bytes,
                        self.committed.load_state_bytes, self._background_failed,
                        lambda source, epoch: self.link.state_received(self.slot, epoch, source, self.training.step))

    # ------------------------------------------------------------------ what the entry and the step read
    def mark(self) -> int:
        return self.training.mark(self.policy.impl)

    def enter_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def _gradients_ready(self) -> None:
        """This member's gradients are computed; its backward now waits for the sums (the reducer)."""
        self._gradients_at = time.perf_counter()
        self.enter_phase("communicate")

    def gradients_at(self, reset: bool = False) -> float | None:
        """When this step's gradients were all computed (None: not yet); `reset` at a step's start."""
        if reset:
            self._gradients_at = None
        return self._gradients_at

    def _resize_vote(self, extras: int, now: bool) -> None:
        self.policy.impl.vote_extras = extras
        if now:
            self.policy.impl.refit_vote()

    def newest_plan(self) -> Plan:
        """The newest plan received (a replica runs only once it has its first)."""
        latest = self.plans.latest
        if latest is None:
            raise RuntimeError(f"{self.slot} has received no plan")
        return latest

    # ------------------------------------------------------------------ control (any thread)
    def ready(self, fired_faults: tuple[int, ...] = ()) -> ReadyAnswer:
        self.faults.already_fired(fired_faults)
        model = self.training.model
        return ReadyAnswer(self.slot, os.getpid(), self.node_ip, checksum=checksum(model.parameters()),
                           batch_norm=any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()))

    def set_plan(self, plan: Plan) -> None:
        self.plans.add(plan)
        if plan.aborts_epoch is not None:  # after: the failed step finds the plan that follows it here
            self.abort_epoch(plan.aborts_epoch, plan.reason)

    def abort_epoch(self, membership_epoch: int, reason: str) -> None:
        comm = self.group.abort(self.plan, membership_epoch, reason)
        exit_now = self._exit_if_stuck
        if comm is not None and self.phase in STEP_PHASES and exit_now is not None:
            grace = max(STUCK_AFTER_ABORT_S, 5.0 * self.reporter.compute_s)
            watch_release(lambda: self.group.comm is not comm or self.phase not in STEP_PHASES, grace,
                          lambda: exit_now(f"the step of {self.slot} still runs {grace:.0f}s after group {comm.name} "
                                           f"was aborted ({reason}): an operation stuck in C++ that the abort did "
                                           f"not release"))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(self.training.step, self.phase, time.monotonic() - self.phase_since)

    def status(self) -> WorkerStatus:
        plan = self.plan
        mark, digest = self.committed.committed_view()
        rank = plan.rank_of(self.slot) if plan else None
        return WorkerStatus(self.slot, os.getpid(), mark, digest, self.state, self.training.holds_state,
                            -1 if rank is None else rank, plan.membership_epoch if plan else 0, self.plans.latest)

    def load_checkpoint(self, data: bytes) -> int:
        """Resume: this member starts from a disk checkpoint; the epoch start spreads it to the rest."""
        self.committed.load_state_bytes(data)
        return self.training.step

    def final_state(self) -> bytes:
        """The committed training state (model, optimizer, step, data position, ...), as a checkpoint holds it
        (with replica groups: as rank 0 gathered it at the end of the run)."""
        return self.committed.final_bytes()

    def evaluate_state(self, blob: bytes) -> dict:
        """The workload's metrics of a model state (the average of the replicas), on a copy of the model."""
        evaluate, data = getattr(self.workload, "evaluate", None), getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        model = copy.deepcopy(self.training.model)
        model.load_state_dict(read_state(blob)["model"])
        model.eval()
        return metrics_of(evaluate, model, data, self.training.step)

    def records_after(self, step: int) -> tuple[dict, ...]:
        """The kept history records of commit points after `step` (a restarted coordinator's catch-up)."""
        return self.reporter.after(step)

    def watch(self) -> RunOutcome:
        """Returns when run() ends, with its outcome."""
        self._finished.wait()
        return self._outcome

    def switch_policy(self, sync: dict, compression: dict) -> None:
        """Run `sync`/`compression` from now on (a policy switched to mid-run, or the policy a state was
        saved under), from the newest commit point, where a switchable policy's replicas agree
        (orchestrator/planner.py `SWITCHABLE`): a periodic member that meets the switch between rounds
        rewinds its provisional local steps first. The model and the optimizer stay; the old policy's
        hooks go; the new one starts with fresh state of its own (its outer momentum, its residuals)."""
        cfg = self.policy.config_with(sync, compression)
        if cfg is None:
            return
        if self.training.provisional(self.policy.impl):
            self.committed.rewind()  # provisional local steps (met between rounds, after an abort): the new policy redoes them
        log.info("%s switches policy at step %d: %s -> %s", self.slot, self.training.step, self.policy.cfg.sync.policy,
                 cfg.sync.policy)
        self.policy.impl.detach()
        self.policy = self._bind(cfg, len(self.metrics.names))
        self.policy.impl.start_at(self.training.step)  # e.g. a periodic policy's first committed state: this step's

    def train_shards(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """A replica group's entry re-cut the replica: train this member's new shard (`model`, `optimizer`
        over the new group) from here, under the same policy bound to it."""
        cfg = self.policy.cfg
        self.training.adopt(model, guarded(optimizer, cfg.optimizer.clip_grad_norm, self.training.precision))
        self.policy.impl.detach()
        self.policy = self._bind(cfg, len(self.metrics.names))

    def _bind(self, cfg: JobConfig, vote_extras: int = 0) -> PolicyBinding:
        """`cfg`'s policy bound to the model and optimizer trained now (and to its shards, with replica groups)."""
        binding = PolicyBinding.bind(cfg, self.training.model, self._optimizer(), self._gradients_ready, vote_extras)
        if isinstance(binding.impl, Sharded) and self.shards is not None:
            binding.impl.attach(self.shards)
        return binding

    def _optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the policies step: the training state's guard (clipping, fp16's loss scale), which
        has torch's optimizer surface (`param_groups`, `state`, `step`, `zero_grad`, `state_dict`)."""
        return cast(torch.optim.Optimizer, self.training.optimizer)

    # ------------------------------------------------------------------ the loop
    def run(self) -> RunOutcome:
        try:
            if self.device.type == "cuda":  # this thread's current device (its streams, its group's)
                torch.cuda.set_device(self.device)
            self._loop()
            self._outcome = RunOutcome(True, self.training.step, self.slot, holds_state=self.training.holds_state)
            self.state = "finished"
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the coordinator
            self.state = "failed"
            self._outcome = failure_outcome(err, self.training.step, self.slot)
        finally:
            self.feed.close()
            if self.shards is not None:
                self.shards.leave()  # torch forgets the group before it is released
            self.group.withdraw()
            self.policy.impl.close(finished=self.state == "finished" and not self._left)
            self.flush(force=True)
            self.reporter.await_checkpoints()
            self._finished.set()
        return self._outcome

    def flush(self, force: bool = False, wait: bool | None = None) -> None:
        self.reporter.flush(self.plan, self.training.step, self.mark(), force, wait)

    def _loop(self) -> None:
        self.enter_phase("waiting")
        self.plan = self.plans.admission(self.slot)
        while True:
            if not self.policy.algorithm.entry.forms_group:
                self.plan = self.newest_plan()  # no lockstep to keep: such a member takes a plan at once
            plan = self._plan_now()
            if plan.rank_of(self.slot) is None:
                self._left = True
                return  # left the job (scale-down): finish cleanly
            comm = self.group.comm
            if comm is None or comm.name != plan.group_name:
                if not self._entry.enter(plan):
                    self.enter_phase("waiting")
                    self.plan = self.plans.newer_than(plan.version)
                    continue
            stop_at = self._stop_at(plan)
            if self.policy.impl.sync_due(self.training.step, stop_at):
                ok = self._steps.sync(plan)
            elif (stop_at is not None and self.training.step >= stop_at) or self.policy.impl.stop_requested():
                if self._steps.finish(plan):
                    return
                ok = False
            else:
                ok = self._steps.train(plan)
            if ok:
                continue
            self.state = "waiting"
            self.enter_phase("waiting")
            if self.newest_plan().version == plan.version:
                # committed steps go to history now, without waiting for the answer: the coordinator is
                # busy with the failure, and its plan is what this member waits for next (reports keep
                # their order). Where that plan is here already (a death's plan carries its abort), they
                # go with the next report instead, off the re-form's path (rank 0's epoch agreement
                # sends the coordinator any it lacks).
                self.flush(force=True, wait=False)
            self.plan = self.plans.newer_than(plan.version)

    def joining(self) -> None:
        self.state = "joining"
        self.enter_phase("joining")

    def failed_with(self, cause: str) -> None:
        """A collective of this member failed with `cause` (its status says so)."""
        self.cause = cause

    def adopt(self, plan: Plan) -> None:
        """The members agreed to switch to `plan` at this step."""
        self.plan = plan

    def trained_under(self, plan: Plan) -> None:
        """The provisional steps since the last commit are trained under `plan`."""
        self.trained_plan = plan

    def _plan_now(self) -> Plan:
        """The plan this replica runs under (it has one from its admission on)."""
        if self.plan is None:
            raise RuntimeError(f"{self.slot} has not been admitted to a plan")
        return self.plan

    def _stop_at(self, plan: Plan) -> int | None:
        limits = [s for s in (self.policy.max_steps, plan.stop_step) if s is not None]
        return min(limits) if limits else None

    def _background_failed(self, error: str) -> None:
        """A background round failed: the coordinator probes the members and re-forms the group."""
        try:
            self.link.collective_failed(self.slot, self.plan.membership_epoch if self.plan else 0, error[:300])
        except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting
            log.warning("could not tell the coordinator that a background round failed: %s", failure)


def replica_shards(cfg: JobConfig, model: torch.nn.Module) -> ReplicaShards | None:
    """A member's shards of the replica with replica groups (`sharding.group_size` > 1), else None. FSDP and
    torch.distributed.checkpoint are imported only then (seconds of a worker's start otherwise)."""
    if cfg.sharding.group_size == 1:
        return None
    from actors.training.sharded_replica import ReplicaShards

    return ReplicaShards(cfg.sharding.group_size, cfg.sharding.mirror, model, lambda m: build_optimizer(m, cfg.optimizer))


def failure_outcome(err: BaseException, step: int, slot: str) -> RunOutcome:
    """The outcome of a run that raised `err`: a bad sample is the data's error, not this worker's (the
    coordinator ends the job on it); the workload's own code is the coordinator's to judge a bug."""
    if isinstance(err, WorkloadBug):
        log.error("the workload failed: %s\n%s", err.fault.line, err.fault.traceback)
        return RunOutcome(False, step, slot, error=err.fault.line, traceback=err.fault.traceback, workload_fault=err.fault)
    return RunOutcome(False, step, slot, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(),
                      data_fault=err.fault if isinstance(err, BadSample) else None)


STEP_PHASES = ("compute", "communicate")
"""The run thread's phases inside a step, where it may wait on the group's operations."""
STUCK_AFTER_ABORT_S = 10.0
"""How long the run thread may stay inside its step after its group was aborted (at least; 5 steps'
compute time where that is longer) before the worker counts it stuck and exits (`watch_release`)."""


def watch_release(released: Callable[[], bool], grace_s: float, on_stuck: Callable[[], None],
                  poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> threading.Thread:
    """After an abort: a thread that calls `on_stuck` unless `released()` comes true within `grace_s`.

    The abort releases every wait this project makes, and shuts down the pairs of a group lent to torch's
    reducer, so that gloo's own waits fail. One wait has been seen to outlive it: gloo's ring all-reduce,
    inside torch's reducer, waiting to receive from a peer that was SIGKILLed as the abort landed (about
    1 abort in 50 on a loaded 2-core machine; the thread in `UnboundBuffer::waitRecv` with the group's
    timeout, nothing left to wake it). Nothing in Python can release it; the group's timeout
    (`comm.timeout_s`, 120 s by default) would hold every member's next membership meanwhile, so the
    worker exits instead (`on_stuck`), and the coordinator treats it as a death."""
    def watch() -> None:
        deadline = clock() + grace_s
        while clock() < deadline:
            if released():
                return
            sleep(poll_s)
        if not released():
            on_stuck()

    thread = threading.Thread(target=watch, name="release watch", daemon=True)
    thread.start()
    return thread
