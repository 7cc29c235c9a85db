"""One step (or one periodic round) of a replica, and its commit: samples, forward and backward under
the policy's hooks, the vote, the update, and, at a commit point, the record, the checkpoint and the
samples applied; and the rare agreement on a newer plan that members switch to at the same step.

`StepRunner` owns what one step measures (its wait, its skipped samples); it reaches the replica's parts
through the replica (actors/training/parts.py `ReplicaParts`), whose policy binding a switch replaces.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from actors.plan import Plan
from actors.training import first_group
from actors.training.batch_feed import seed_step
from actors.training.checkpoint_writer import Checkpoint
from actors.training.epoch_group import Reducing
from actors.training.parts import ReplicaParts
from actors.training.reporter import StepRecord
from actors.training.user_code import call as user_call
from actors.training.user_code import contract, require_scalar
from actors.training.workload import split_loss
from actors.transport.comm import CommError
from algorithms.policies.base import StepVote, VoteDraft
from algorithms.policies.optim import lr_at

log = logging.getLogger(__name__)
HALF = (torch.float16, torch.bfloat16)


class StepRunner:
    """The step and the round of one replica."""

    def __init__(self, replica: ReplicaParts, tick: Callable[[], None]) -> None:
        self._r = replica
        self._tick = tick
        self._slot_index = int(replica.slot[1:])
        self._skips_bad = replica.policy.cfg.workload.on_bad_sample == "skip"
        self._loss_tokens: Callable[[Any], int] | None = getattr(replica.workload, "loss_tokens", None)
        """The workload counts each batch's loss tokens (padded text): a step's loss is then their mean."""
        self._waited = 0.0
        """Seconds the newest step waited on others: for its samples, the policy's lock, its collectives."""
        self._skipped = 0
        """Samples of the newest step's global batch that no member could read (a synchronous kind that
        skips bad samples counts them over the group): its history record says how many."""

    def train(self, plan: Plan) -> bool:
        r = self._r
        training, impl = r.training, r.policy.impl
        r.enter_phase("samples")
        asked = time.perf_counter()
        dealt = impl.step_samples(training.step)  # a server kind pulls here
        if dealt is not None and not len(dealt):
            return True  # nothing to train now (the server said wait, or finished): the loop looks again
        started = time.perf_counter()
        waited = started - asked
        r.enter_phase("compute")
        self._tick()
        seed_step(r.policy.cfg.seed, self._slot_index, training.step, r.device)
        r.faults.maybe_fire("step", training.step)
        r.faults.maybe_fire("user_exception", training.step)
        if training.step == r.mark():
            r.trained_under(plan)  # the first provisional step after a commit
        dealt_ids, micro = r.feed.micro_batches(plan, training.cursor, dealt)
        ids = micro[0].ids if len(micro) == 1 else np.concatenate([m.ids for m in micro])  # what is trained
        skipped = [i for m in micro for i in m.skipped]
        if skipped:
            r.link.samples_skipped(r.slot, training.step + 1, skipped, "workload.on_bad_sample: skip")
        draft = VoteDraft(samples=len(dealt_ids), newer_plan=r.newest_plan().version > plan.version)
        began = time.perf_counter()
        r.gradients_at(reset=True)
        impl.begin_step(training.step, draft)  # the background kind waits here for its lock
        waited += time.perf_counter() - began
        try:
            weights = self._weights(plan, len(dealt_ids), micro)
            impl.before_forward(training.step)  # a gossip exchange launches here (and may fail)
            for i, fetched in enumerate(micro):
                impl.accumulating = i < len(micro) - 1
                weight = weights[i]  # each sample counts 1/B (shares) or 1/n_i (own mean), however split
                try:
                    loss, metrics = self._loss(fetched.batch)
                except Exception as err:  # noqa: BLE001 - raised again, by reraise
                    impl.reraise(err)  # the policy's communication in the forward (FSDP's gathers) is the group's
                scaled = (loss.float() if loss.dtype in HALF else loss) * weight  # a half loss, scaled in float32
                share = scaled.detach()  # before the backward that may launch the vote
                draft.loss = share if i == 0 else draft.loss + share
                draft.extras = r.metrics.weighted(metrics, weight, draft.extras if i else None, r.workload.loss,
                                                  training.step + 1)
                multiplier = training.optimizer.loss_multiplier  # fp16's loss scale: unscaled at the update
                impl.backward(scaled * multiplier if multiplier != 1.0 else scaled)
            impl.end_backward(training.step)
            if r.gradients_at() is None:
                r.enter_phase("communicate")
            spent = (r.gradients_at() or time.perf_counter()) - started  # compute: until this member's gradients are in
            vote = impl.finish_step(training.step, draft)
            waited += time.perf_counter() - started - spent
            r.faults.lose_vote(training.step)
        except CommError as err:
            if impl.commit_mark is None:
                r.samples.attempted(training.step + 1, ids)  # applied if some member committed it (a split vote)
            return self.failed(plan, err)
        spent += r.faults.straggle(started, training.step)  # a modelled straggler's sleep is compute time
        r.reporter.timed(spent)
        if vote.communicated and r.policy.algorithm.kind.reduces_every_step and vote.samples != plan.global_batch:
            raise RuntimeError(f"the commit vote of step {training.step + 1} counted {vote.samples} samples; the plan's "
                               f"global batch is {plan.global_batch}")  # every member runs one plan: a bug, not a vote
        impl.apply_update(training.step, lr_at(training.step, r.policy.cfg.optimizer, r.policy.max_steps, plan.lr_scale))
        training.advance(plan.global_batch)
        r.samples.trained(training.step, ids)
        self._waited = waited
        if impl.commit_mark is None:  # every step is a commit point
            self.commit(plan, vote, started, len(micro))
        # Only a reduced vote is everyone's: members switch plans together, never on a local step's flag.
        return self.adopt_newest_plan(plan) if vote.newer_plan and vote.communicated else True

    def _loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """The workload's loss of a batch and its step metrics (`split_loss`); what its code raises, or a
        loss that is not a scalar, leaves as a `WorkloadBug` (actors/training/user_code.py)."""
        r = self._r
        loss_fn, step = r.workload.loss, r.training.step + 1
        with r.training.precision.forward():  # autocast in the mixed modes
            returned = user_call("loss", loss_fn, r.training.model, batch, step=step)
        with contract("loss", loss_fn, step):
            loss, metrics = split_loss(returned)
            require_scalar(loss)
        return loss, metrics

    def _weights(self, plan: Plan, dealt: int, micro: list[Any]) -> list[float]:
        """What each micro-batch's loss (its mean) is multiplied by, so that the step's gradient is the
        mean over the samples read, or, where the workload counts loss tokens (`loss_tokens`: padded
        text), over the loss tokens read: each micro-batch weighs its samples (tokens) over the
        denominator. That is this member's own count for the kinds whose members update their own
        replica; the global batch's for the kinds that reduce every step, counted over the group (one
        all-reduce of two numbers a step, only with `workload.on_bad_sample: skip` or loss tokens: else
        it is the plan's global batch); a server kind's member, which pushes alone, weighs its share by
        the samples dealt to it and its samples (tokens) by their mean within it."""
        self._skipped = 0
        algorithm = self._r.policy.algorithm
        counts = [self._loss_tokens(m.batch) if self._loss_tokens else len(m.ids) for m in micro]
        read, local = sum(len(m.ids) for m in micro), sum(counts)
        denominator: float
        if algorithm.local_mean:
            denominator = max(local, 1)
        elif not (self._skips_bad or self._loss_tokens):
            denominator = plan.global_batch
        elif not algorithm.kind.reduces_every_step:
            denominator = plan.global_batch * local / max(dealt, 1)
        else:
            total_read, total = self._over_group(plan, read, local)
            self._skipped = plan.global_batch - total_read
            denominator = max(total, 1)
        return [count / denominator for count in counts]

    def _over_group(self, plan: Plan, read: int, counted: int) -> tuple[int, int]:
        """(samples read, samples or tokens counted) summed over the plan's members."""
        comm = self._r.group.comm
        if len(plan.members) == 1 or not isinstance(comm, Reducing):
            return read, counted
        sums = torch.tensor([float(read), float(counted)], device=comm.device)  # exact below 2^24
        comm.all_reduce(sums, "sum").wait()
        return int(round(float(sums[0]))), int(round(float(sums[1])))

    def sync(self, plan: Plan) -> bool:
        """A periodic round: its vote is the commit point of the local steps since the last one."""
        r = self._r
        started = time.perf_counter()
        r.enter_phase("communicate")
        draft = VoteDraft(newer_plan=r.newest_plan().version > plan.version)
        try:
            vote = r.policy.impl.sync(r.training.step, draft)
            if vote is None:
                return True  # launched; merged (and committed) after the overlap
            r.faults.lose_vote(r.training.step)
        except CommError as err:
            return self.failed(plan, err)
        self._waited = time.perf_counter() - started  # a round is all communication
        self.commit(plan, vote, started, 0)
        return self.adopt_newest_plan(plan) if vote.newer_plan else True

    def failed(self, plan: Plan, err: CommError) -> bool:
        self._collective_failed(plan, err)
        self._r.policy.impl.discard(self._r.training.step)
        return False

    def _collective_failed(self, plan: Plan, err: CommError) -> None:
        """This member's status says so, and the coordinator hears of it (unless the group was aborted,
        which is the coordinator's own doing)."""
        r = self._r
        r.failed_with(str(err))
        comm = r.group.comm
        if not comm or not comm.aborted:  # a peer may be gone without Ray knowing (a lost node)
            try:
                r.link.collective_failed(r.slot, plan.membership_epoch, str(err)[:300])
            except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting; its abort comes anyway
                log.warning("could not tell the coordinator that a collective failed: %s", failure)

    def commit(self, plan: Plan, vote: StepVote, started: float, micro_steps: int) -> None:
        """This step (or round) is the newest committed state: mark it, record it, save it if due."""
        r = self._r
        training, impl, algorithm = r.training, r.policy.impl, r.policy.algorithm
        newest = r.reporter.newest()
        prev = newest["step"] if newest else None
        r.feed.source.committed(training.commit(impl))
        r.trained_under(plan)
        r.samples.committed(plan.membership_epoch)
        record = StepRecord(
            step=training.step, loss=float(vote.loss), plan=plan, micro_steps=micro_steps,
            bytes_sent=r.group.bytes_sent(impl), lr=training.optimizer.param_groups[0]["lr"],
            step_time=time.perf_counter() - started, wait_s=self._waited, samples=vote.samples, prev=prev,
            provisional=impl.commit_mark is not None, step_metrics=r.metrics.named(vote.extras) if vote.extras else {},
            policy_fields=impl.record_fields(), dropped=r.samples.take_dropped(), skipped=self._skipped,
            grad_norm=None if training.optimizer.grad_norm is None else float(training.optimizer.grad_norm),
            skipped_updates=training.optimizer.skipped,
            tensor_bytes=r.shards.held_bytes() if r.shards is not None and (
                newest is None or newest.get("membership_epoch") != plan.membership_epoch) else None)
        evaluated = self._evaluated_in_shares(plan, prev, training.step)
        r.reporter.record(record, algorithm, training.model, impl, lambda: (training.step, r.mark()), evaluated)
        checkpoint: Callable[[bool], Checkpoint] | None = r.committed.checkpoint
        if r.shards is not None and r.reporter.checkpoint_due(algorithm, prev, training.step):
            checkpoint = first_group.lost_to(lambda: first_group.checkpoint(r), f"the checkpoint at step {training.step}",
                                             lambda err: self._collective_failed(plan, err), None)
        if checkpoint is not None:
            r.reporter.maybe_checkpoint(plan, algorithm, prev, training.step, r.mark(), checkpoint)
        r.group.settle()  # off the next re-form's path, now that this one's first step is done

    def finish(self, plan: Plan) -> bool:
        """The end of the run: the final record (rank 0 evaluates the final model; with replica groups the
        first group gathers the replica and evaluates it together first). False where that group failed
        (the loop waits for the next plan, and ends under it)."""
        r = self._r
        evaluated = None
        if r.shards is not None:
            try:
                evaluated = first_group.finish(r, plan)
            except CommError as err:
                r.failed_with(str(err))
                return False
        r.reporter.final(r.plan, r.training.model, r.policy.impl, r.training.step, evaluated)
        return True

    def _evaluated_in_shares(self, plan: Plan, prev: int | None, step: int) -> dict | None:
        """Where the evaluation at this commit point is split (`Evaluation.splits`), every member evaluates
        its share and all get the metrics; else None (rank 0 evaluates alone, in `record`). A failure of
        the group here loses this evaluation only: the coordinator hears of it as of a step's, and the
        next step re-forms the group."""
        r = self._r
        evaluation, comm, rank = r.reporter.evaluation, r.group.comm, plan.rank_of(r.slot)
        if r.shards is not None:  # the sharded model's forward is its group's to run together: the first group's
            if not r.reporter.evaluation_due(prev, step):
                return None
            lost: dict | None = {}  # not None: rank 0 would then evaluate alone, which it cannot
            return first_group.lost_to(lambda: first_group.evaluate(r, step), f"the evaluation at step {step}",
                                       lambda err: self._collective_failed(plan, err), lost)
        if (not r.reporter.evaluation_due(prev, step) or rank is None or not isinstance(comm, Reducing)
                or not evaluation.splits(r.policy.algorithm.kind, r.policy.impl, len(plan.members))):
            return None
        try:
            return evaluation.in_shares(r.training.model, rank, len(plan.members), comm, step)
        except CommError as err:
            log.warning("the evaluation at step %d was lost: %s", step, str(err).splitlines()[0][:200])
            self._collective_failed(plan, err)
            return {}

    def adopt_newest_plan(self, plan: Plan) -> bool:
        """Rare path: someone saw a newer plan; agree on the newest with one MAX all-reduce, then every
        member switches to it at this same step (after `_flush_for_switch` where it switches policy)."""
        r = self._r
        comm = r.group.comm
        if not isinstance(comm, Reducing):
            raise RuntimeError(f"{r.slot} has no group to agree on the newest plan in")
        version = torch.tensor([float(r.newest_plan().version)], device=comm.device)
        try:
            comm.all_reduce(version, "max").wait()
        except CommError as err:
            r.failed_with(str(err))
            return False
        agreed = r.plans.agreed(int(version[0]))
        if agreed is None:
            return False  # superseded before it arrived: the loop takes the newest
        if not self._flush_for_switch(plan, agreed):
            return False
        r.adopt(agreed)
        return True

    def _flush_for_switch(self, plan: Plan, agreed: Plan) -> bool:
        """Leaving a policy whose replicas differ at a commit point (streaming DiLoCo's fragments merge
        at different steps) for another policy, with the same members: every fragment not synchronized
        at this step has its round now, on this group, as at the end of a run (`sync_due` with the stop
        at this step), so every member switches from the same, exactly averaged parameters and loses none
        of its local steps. Every member decides alike (the plan is the agreed one, the step the commit's).
        False where a round failed (the loop takes the newest plan; a later switch takes rank 0's state).
        Elsewhere nothing to do: a switchable policy's replicas agree at each commit."""
        r = self._r
        impl, step = r.policy.impl, r.training.step
        if impl.replicas_agree_at_commit or agreed.policy is None or agreed.members != plan.members \
                or r.policy.config_with(agreed.policy["sync"], agreed.policy["compression"]) is None:
            return True
        log.info("%s synchronizes every fragment at step %d before switching to %s", r.slot, step, agreed.policy["label"])
        while impl.sync_due(step, step):
            started = time.perf_counter()
            try:
                vote = impl.sync(step, VoteDraft())
            except CommError as err:
                return self.failed(plan, err)
            if vote is not None:  # at the stop a round merges at its launch
                self._waited = time.perf_counter() - started
                self.commit(plan, vote, started, 0)
        return True
