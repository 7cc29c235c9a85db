"""One training replica: model, optimizer, data shard and the step loop. No Ray here.

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
"""
from __future__ import annotations

import copy
import io
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from actors.plan import Plan, WorkerSpec
from actors.training.replica_base import Link, Reducing
from actors.training.replica_epochs import EpochEntry
from actors.training.replica_feed import Feeding
from actors.training.replica_reports import Reporting
from actors.training.replica_state import checksum
from actors.training.sources import BadSample
from actors.training.user_code import WorkloadBug, contract, metrics_of, require_scalar
from actors.training.user_code import call as user_call
from actors.training.workload import build_workload, split_loss, time_steps, warm_up  # noqa: F401 - their importers' old home (worker, loader, probe, planner)
from actors.transport import collective
from actors.transport.comm import BaseCommunicator, CommError
from algorithms.policies.base import EpochInfo, StepVote, VoteDraft
from algorithms.policies.optim import lr_at

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


class Replica(EpochEntry, Feeding, Reporting):
    """The step loop and the calls the worker actor makes. Its parts are built by `ReplicaBase`
    (actors/training/replica_base.py) and its phases are mixins: membership epochs (actors/training/replica_epochs.py),
    the committed state (actors/training/replica_state.py), the data feed (actors/training/replica_feed.py), reports and
    checkpoints (actors/training/replica_reports.py)."""

    def __init__(self, spec: WorkerSpec, link: Link, node_ip: str, tick: Callable[[], None] = lambda: None,
                 kill_actor: Callable[[], None] = lambda: None, server: Any = None, workload: Any = None) -> None:
        """`server`: the parameter server's client (algorithms/policies/server_policies.py), for server kinds;
        the rest as `ReplicaBase`'s."""
        super().__init__(spec, link, node_ip, tick, kill_actor, workload)
        if server is not None and self.algorithm.kind in ("server", "background") and isinstance(self.impl, ServerBound):
            self.impl.connect(server, self.slot, spec.incarnation)  # fenced by (slot, worker incarnation)
        if self.algorithm.kind == "background" and isinstance(self.impl, Backgrounded):  # its own group per epoch
            self.impl.attach(self._background_group, self._state_bytes, self._load_state_bytes, self._background_failed,
                             lambda source, epoch: self.link.state_received(self.slot, epoch, source, self.step))

    # ------------------------------------------------------------------ control (any thread)
    def ready(self, fired_faults: tuple[int, ...] = ()) -> dict:
        self.faults.fired = set(fired_faults)
        return {"slot": self.slot, "pid": os.getpid(), "node": self.node_ip, "checksum": checksum(self.model.parameters()),
                "batch_norm": any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules())}

    def set_plan(self, plan: Plan) -> None:
        self.plans.add(plan)
        if plan.aborts_epoch is not None:  # after: the failed step finds the plan that follows it here
            self.abort_epoch(plan.aborts_epoch, plan.reason)

    def abort_epoch(self, membership_epoch: int, reason: str) -> None:
        comm, plan = self.comm, self.plan
        if comm is not None and plan is not None and plan.membership_epoch <= membership_epoch:
            comm.abort(reason)
            exit_now = self.exit_if_stuck
            if self.phase in STEP_PHASES and exit_now is not None:
                grace = max(STUCK_AFTER_ABORT_S, 5.0 * self.compute_s)
                watch_release(lambda: self.comm is not comm or self.phase not in STEP_PHASES, grace,
                              lambda: exit_now(f"the step of {self.slot} still runs {grace:.0f}s after group "
                                                         f"{comm.name} was aborted ({reason}): an operation stuck in C++ "
                                                         f"that the abort did not release"))

    def heartbeat(self) -> dict:
        """Cheap liveness and progress: what the run thread is doing and for how long."""
        return {"step": self.step, "phase": self.phase, "phase_age_s": time.monotonic() - self.phase_since}

    def status(self) -> dict:
        plan = self.plan
        mark, digest = self.committed_view()
        return {"slot": self.slot, "pid": os.getpid(), "step": mark, "checksum": digest, "state": self.state,
                "holds_state": self.holds_state,
                "rank": plan.rank_of(self.slot) if plan else -1, "membership_epoch": plan.membership_epoch if plan else 0,
                "plan": self.plans.latest}

    def load_checkpoint(self, data: bytes) -> int:
        """Resume: this member starts from a disk checkpoint; the epoch start spreads it to the rest."""
        self._load_state_bytes(data)
        return self.step

    def final_state(self) -> bytes:
        """The committed training state (model, optimizer, step, data position, ...), as a checkpoint holds it."""
        return self._state_bytes()

    def evaluate_state(self, blob: bytes) -> dict:
        """The workload's metrics of a model state (the average of the replicas), on a copy of the model."""
        evaluate, data = getattr(self.workload, "evaluate", None), getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        model = copy.deepcopy(self.model)
        model.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")["model"])
        model.eval()
        return metrics_of(evaluate, model, data, self.step)

    def records_after(self, step: int) -> tuple[dict, ...]:
        """The kept history records of commit points after `step` (a restarted coordinator's catch-up)."""
        return tuple(r for r in list(self.kept) if r["step"] > step)

    def watch(self) -> dict:
        """Returns when run() ends, with its outcome."""
        self._finished.wait()
        return self._outcome

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        try:
            self._loop()
            self._outcome = {"ok": True, "step": self.step, "slot": self.slot, "holds_state": self.holds_state}
            self.state = "finished"
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the coordinator
            self.state = "failed"
            self._outcome = {"ok": False, "step": self.step, "slot": self.slot, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()}
            if isinstance(err, BadSample):  # the data's error, not this worker's: the coordinator ends the job on it
                self._outcome["data_fault"] = err.fault
            if isinstance(err, WorkloadBug):  # the workload's own code: the coordinator decides whether it is a bug
                self._outcome.update(error=err.fault.line, traceback=err.fault.traceback, workload_fault=err.fault)
                log.error("the workload failed: %s\n%s", err.fault.line, err.fault.traceback)
        finally:
            if self._loader is not None:
                self._loader.close()
            if self._fetcher is not None:
                self._fetcher.close()
            collective.withdraw(self.comm)
            self.impl.close(finished=self.state == "finished" and not self._left)
            self._flush_report(force=True)
            self._await_checkpoints()
            self._finished.set()
        return self._outcome

    def _loop(self) -> None:
        self._enter_phase("waiting")
        self.plan = self.plans.admission(self.slot)
        while True:
            if self.algorithm.entry in ("server", "none"):
                self.plan = self._newest_plan()  # no lockstep to keep: such a member takes a plan at once
            plan = self._plan_now()
            if plan.rank_of(self.slot) is None:
                self._left = True
                return  # left the job (scale-down): finish cleanly
            if self.comm is None or self.comm.name != plan.group_name:
                if not self._enter_epoch(plan):
                    self._enter_phase("waiting")
                    self.plan = self.plans.newer_than(plan.version)
                    continue
            stop_at = self._stop_at(plan)
            if self.impl.sync_due(self.step, stop_at):
                ok = self._sync(plan)
            elif (stop_at is not None and self.step >= stop_at) or self.impl.stop_requested():
                self._final_eval()
                return
            else:
                ok = self._train_step(plan)
            if not ok:
                self.state = "waiting"
                self._enter_phase("waiting")
                if self._newest_plan().version == plan.version:
                    # committed steps go to history now, without waiting for the answer: the coordinator is
                    # busy with the failure, and its plan is what this member waits for next (reports keep
                    # their order). Where that plan is here already (a death's plan carries its abort), they
                    # go with the next report instead, off the re-form's path (rank 0's epoch agreement
                    # sends the coordinator any it lacks).
                    self._flush_report(force=True, wait=False)
                self.plan = self.plans.newer_than(plan.version)

    def _stop_at(self, plan: Plan) -> int | None:
        limits = [s for s in (self.max_steps, plan.stop_step) if s is not None]
        return min(limits) if limits else None

    def _train_step(self, plan: Plan) -> bool:
        self._enter_phase("samples")
        asked = time.perf_counter()
        dealt = self.impl.step_samples(self.step)  # a server kind pulls here
        if dealt is not None and not len(dealt):
            return True  # nothing to train now (the server said wait, or finished): the loop looks again
        started = time.perf_counter()
        waited = started - asked
        self._enter_phase("compute")
        self._tick()
        self._seed_step()
        self.faults.maybe_fire("step", self.step)
        self.faults.maybe_fire("user_exception", self.step)
        if self.step == self._mark():
            self.trained_plan = plan  # the first provisional step after a commit
        dealt_ids, micro = self._micro_batches(plan, dealt)
        if self._copy_stream is not None:
            self._ready(micro)
        ids = micro[0].ids if len(micro) == 1 else np.concatenate([m.ids for m in micro])  # what is trained
        skipped = [i for m in micro for i in m.skipped]
        if skipped:
            self.link.samples_skipped(self.slot, self.step + 1, skipped, "workload.on_bad_sample: skip")
        draft = VoteDraft(samples=len(dealt_ids), newer_plan=self._newest_plan().version > plan.version)
        began = time.perf_counter()
        self._gradients_at = None
        self.impl.begin_step(self.step, draft)  # the background kind waits here for its lock
        waited += time.perf_counter() - began
        try:
            denominator = self._denominator(plan, len(dealt_ids), len(ids))
            self.impl.before_forward(self.step)  # a gossip exchange launches here (and may fail)
            for i, fetched in enumerate(micro):
                batch, n = fetched.batch, len(fetched.ids)
                self.impl.accumulating = i < len(micro) - 1
                weight = n / denominator  # each sample counts 1/B (shares) or 1/n_i (own mean), however split
                loss, metrics = self._loss(batch)
                scaled = loss * weight
                share = scaled.detach()  # before the backward that may launch the vote
                draft.loss = share if i == 0 else draft.loss + share
                draft.extras = self._weighted_metrics(metrics, weight, draft.extras if i else None)
                self.impl.backward(scaled)
            self.impl.end_backward(self.step)
            if self._gradients_at is None:
                self._enter_phase("communicate")
            spent = (self._gradients_at or time.perf_counter()) - started  # compute: until this member's gradients are in
            vote = self.impl.finish_step(self.step, draft)
            waited += time.perf_counter() - started - spent
            self.faults.lose_vote(self.step)
        except CommError as err:
            if self._samples is not None and self.impl.commit_mark is None:
                self._pending_ids = [(self.step + 1, ids)]  # applied if some member committed it (a split vote)
            return self._failed(plan, err)
        spent += self.faults.straggle(started, self.step)  # a modelled straggler's sleep is compute time
        self.compute_s = 0.9 * self.compute_s + 0.1 * spent if self.compute_s else spent
        self._step_s.append(spent)
        if vote.communicated and self.algorithm.kind == "synchronous" and vote.samples != plan.global_batch:
            raise RuntimeError(f"the commit vote of step {self.step + 1} counted {vote.samples} samples; the plan's "
                               f"global batch is {plan.global_batch}")  # every member runs one plan: a bug, not a vote
        self.impl.apply_update(self.step, lr_at(self.step, self.cfg.optimizer, self.max_steps, plan.lr_scale))
        self.step += 1
        self.holds_state = True
        self.cursor += plan.global_batch
        if self._samples is not None:
            self._pending_ids.append((self.step, ids))
        self._waited = waited
        if self.impl.commit_mark is None:  # every step is a commit point
            self._commit(plan, vote, started, len(micro))
        # Only a reduced vote is everyone's: members switch plans together, never on a local step's flag.
        return self._adopt_newest_plan(plan) if vote.newer_plan and vote.communicated else True

    def _loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The workload's loss of a batch and its step metrics (`split_loss`); what its code raises, or a
        loss that is not a scalar, leaves as a `WorkloadBug` (actors/training/user_code.py)."""
        loss_fn, step = self.workload.loss, self.step + 1
        returned = user_call("loss", loss_fn, self.model, batch, step=step)
        with contract("loss", loss_fn, step):
            loss, metrics = split_loss(returned)
            require_scalar(loss)
        return loss, metrics

    def _weighted_metrics(self, metrics: dict[str, Any], weight: float, before: tuple | None) -> tuple:
        """A micro-step's step metrics (`split_loss`), weighted as its loss is and added to the step's so far
        (`before`; None at the first micro-step), in the order of `metric_names`. At the first micro-step of
        the first step this process trains, the names are taken (the vote is refit to carry them: on a
        fresh job every member does so at the same step, and a member that loaded a state holds its
        names already); from then on they must stay the same, or the members' votes would differ in width."""
        names = tuple(sorted(metrics))
        if names != self.metric_names:
            if before is not None or self._metrics_settled:
                with contract("loss", self.workload.loss, self.step + 1):  # the workload's mistake: a WorkloadBug
                    raise ValueError(f"workload.loss returned the step metrics {list(names)} at step {self.step + 1}, "
                                     f"and {list(self.metric_names)} before: return the same names at every step")
            self._set_metric_names(names)
            self.impl.refit_vote()
        self._metrics_settled = True
        weighted = tuple(metrics[name] * weight for name in names)
        return weighted if before is None else tuple(a + b for a, b in zip(before, weighted))

    def _denominator(self, plan: Plan, dealt: int, read: int) -> float:
        """What each sample's loss is divided by, so that the step's gradient is the mean over the samples
        read: this member's own (the kinds whose members update their own replica), else the global
        batch's. With `workload.on_bad_sample: skip` a member reads fewer than it was dealt, and the
        global batch's samples read are counted over the group (one all-reduce of a number a step, only
        then); a server kind's member, which pushes alone, counts its share as dealt, its read samples'
        mean within it."""
        self.skipped_now = 0
        if self.algorithm.local_mean:
            return max(read, 1)
        if not self.skips_bad:
            return plan.global_batch
        if self.algorithm.kind != "synchronous":
            return plan.global_batch * read / max(dealt, 1)
        comm = self.comm
        total = read
        if len(plan.members) > 1 and isinstance(comm, Reducing):
            count = torch.tensor([float(read)], device=comm.device)
            comm.all_reduce(count, "sum").wait()
            total = int(round(float(count[0])))
        self.skipped_now = plan.global_batch - total
        return max(total, 1)

    def _sync(self, plan: Plan) -> bool:
        """A periodic round: its vote is the commit point of the local steps since the last one."""
        started = time.perf_counter()
        self._enter_phase("communicate")
        draft = VoteDraft(newer_plan=self._newest_plan().version > plan.version)
        try:
            vote = self.impl.sync(self.step, draft)
            if vote is None:
                return True  # launched; merged (and committed) after the overlap
            self.faults.lose_vote(self.step)
        except CommError as err:
            return self._failed(plan, err)
        self._waited = time.perf_counter() - started  # a round is all communication
        self._commit(plan, vote, started, 0)
        return self._adopt_newest_plan(plan) if vote.newer_plan else True

    def _failed(self, plan: Plan, err: CommError) -> bool:
        self.cause = str(err)
        self.impl.discard(self.step)
        if not self.comm or not self.comm.aborted:  # a peer may be gone without Ray knowing (a lost node)
            try:
                self.link.collective_failed(self.slot, plan.membership_epoch, str(err)[:300])
            except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting; its abort comes anyway
                log.warning("could not tell the coordinator that a collective failed: %s", failure)
        return False

    def _commit(self, plan: Plan, vote: StepVote, started: float, micro_steps: int) -> None:
        """This step (or round) is the newest committed state: mark it, record it, save it if due."""
        prev = self.kept[-1]["step"] if self.kept else None
        self.impl.commit(self.step)
        self.mark_cursor = self.cursor
        self.source.committed(self.mark_cursor)
        self.trained_plan = plan
        self._dropped_slots = set()
        self._write_samples(self._pending_ids, plan.membership_epoch)
        self._pending_ids = []
        self._record(plan, vote, started, micro_steps, prev)
        self._maybe_checkpoint(plan, prev)
        if self._settle_due and self.comm is not None:
            self._settle_due = False
            self.comm.settled()  # off the next re-form's path, now that this one's first step is done

    def _adopt_newest_plan(self, plan: Plan) -> bool:
        """Rare path: someone saw a newer plan; agree on the newest with one MAX all-reduce, then every
        member switches to it at this same step (after `_flush_for_switch` where it switches policy)."""
        comm = self.comm
        if not isinstance(comm, Reducing):
            raise RuntimeError(f"{self.slot} has no group to agree on the newest plan in")
        version = torch.tensor([float(self._newest_plan().version)], device=comm.device)
        try:
            comm.all_reduce(version, "max").wait()
        except CommError as err:
            self.cause = str(err)
            return False
        agreed = self.plans.agreed(int(version[0]))
        if agreed is None:
            return False  # superseded before it arrived: the loop takes the newest
        if not self._flush_for_switch(plan, agreed):
            return False
        self.plan = agreed
        return True

    def _flush_for_switch(self, plan: Plan, agreed: Plan) -> bool:
        """Leaving a policy whose replicas differ at a commit point (streaming DiLoCo's fragments merge
        at different steps) for another policy, with the same members: every fragment not synchronized
        at this step has its round now, on this group, as at the end of a run (`sync_due` with the stop
        at this step), so every member switches from the same, exactly averaged parameters and loses none
        of its local steps. Every member decides alike (the plan is the agreed one, the step the commit's).
        False where a round failed (the loop takes the newest plan; a later switch takes rank 0's state).
        Elsewhere nothing to do: a switchable policy's replicas agree at each commit."""
        if self.impl.replicas_agree_at_commit or agreed.policy is None or agreed.members != plan.members \
                or self._policy_config(agreed.policy["sync"], agreed.policy["compression"]) is None:
            return True
        log.info("%s synchronizes every fragment at step %d before switching to %s", self.slot, self.step,
                 agreed.policy["label"])
        while self.impl.sync_due(self.step, self.step):
            started = time.perf_counter()
            try:
                vote = self.impl.sync(self.step, VoteDraft())
            except CommError as err:
                return self._failed(plan, err)
            if vote is not None:  # at the stop a round merges at its launch
                self._waited = time.perf_counter() - started
                self._commit(plan, vote, started, 0)
        return True


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
