"""What a replica tells its coordinator: a history record for each commit point (with the
evaluation's metrics where one is due), sent in batches at most every REPORT_EVERY_S; and the
checkpoints rank 0 hands over at their steps.

`Reporting` is a mixin of `Replica` (actors/training/replica.py), whose commit calls `_record` and
`_maybe_checkpoint`; a report lost on the way is logged and never stops training.
"""
from __future__ import annotations

import copy
import logging
import time

import torch

from actors.plan import Plan, Progress, turn_steps
from actors.training.replica_state import CommittedState
from actors.training.user_code import metrics_of
from algorithms.policies.base import StepVote

log = logging.getLogger(__name__)

REPORT_EVERY_S = 0.25
REPORTS_PER_S = 2000.0
"""The coordinator's share of reports: a member reports every REPORT_EVERY_S, or less often in a job
so large that all of them together would send more than this many per second (Ray's own figure for
calls into one async actor from one caller is 4,100-4,800 per second; see docs/control-plane.md)."""
CHECKPOINT_STORED_S = 300.0
"""How long the end of a run waits for its last checkpoint to be stored (a large upload)."""


class Reporting(CommittedState):
    """A `Replica`'s records, reports and checkpoints (a checkpoint holds `CommittedState`'s bytes)."""

    def _maybe_checkpoint(self, plan: Plan, prev: int | None) -> None:
        every = self.cfg.checkpoint.every_steps
        if self.algorithm.final_model == "server" or not crossed(every, prev, self.step):  # the server's state is checkpointed
            return
        self.faults.maybe_fire("checkpoint", self.step)
        if plan.rank_of(self.slot) == 0:
            self._flush_report(force=True)  # history up to this step precedes the checkpoint
            self.link.save_checkpoint(self.step, self._state_bytes())

    def _await_checkpoints(self) -> None:
        """A run ends once the checkpoints it sent are stored: the coordinator stores them off its event
        loop while it goes on, and one sent at the last step (an upload, to an object store) was cut
        off when the job ended and its coordinator exited (CI, S3: step 120's data without its manifest)."""
        try:
            self.link.checkpoints_stored(CHECKPOINT_STORED_S)
        except Exception as err:  # noqa: BLE001 - the coordinator is gone or slow: the run ends regardless
            log.warning("the checkpoint sent last may not be stored: %s", str(err).splitlines()[0][:200])

    def _reports(self, plan: Plan) -> bool:
        return self.algorithm.reporter == "each" or (self.algorithm.reporter == "rank0" and plan.rank_of(self.slot) == 0)

    def _record(self, plan: Plan, vote: StepVote, started: float, micro_steps: int, prev: int | None) -> None:
        record = {"step": self.step, "time": time.time(), "loss": float(vote.loss), "world_size": len(plan.members),
                  "global_batch": plan.global_batch, "micro_steps": micro_steps,
                  "membership_epoch": plan.membership_epoch, "bytes_sent": self.bytes_before + self.impl.bytes_sent,
                  "lr": self.optimizer.param_groups[0]["lr"], "step_time": time.perf_counter() - started,
                  "wait_s": self._waited}
        if vote.extras:  # the workload's step metrics, aggregated as the loss is
            record["step_metrics"] = {name: float(value) for name, value in zip(self.metric_names, vote.extras)}
        if plan.policy is not None:  # switched mid-run: which policy committed it (the trial measures each)
            record["policy"] = plan.policy["label"]
        if self.impl.commit_mark is not None:
            record.update(prev=prev if prev is not None else 0, samples=vote.samples)
        if self.algorithm.reporter == "each":
            record.update(slot=self.slot, samples=vote.samples)
        record.update(self.impl.record_fields())
        if self.tokens_per_sample:  # the step's tokens: the global batch's, or this member's own (per-member kinds)
            record["tokens"] = int(record.get("samples", plan.global_batch)) * self.tokens_per_sample
        if self.dropped:
            record["dropped_samples"], self.dropped = self.dropped, 0
        if self.skipped_now:
            record["skipped_samples"] = self.skipped_now
        self.kept.append(record)
        if self._reports(plan):
            if self._evaluates(plan) and crossed(self.cfg.eval_every, prev if prev is not None else self.step - 1, self.step):
                record.update(self._evaluate())
            self._records.append(record)
        self._flush_report(force=self._turn_ends(plan), wait=False)

    def _turn_ends(self, plan: Plan) -> bool:
        """Whether this step ends a turn of `sync.auto`'s trial: the policy running has committed its turn's
        steps (`turn_steps`) since its first. The turn's last record then goes to the coordinator at once,
        not up to REPORT_EVERY_S later, so the trial moves on without running the candidate for longer."""
        trial = self.cfg.policy_trial
        if not trial or not self._reports(plan):
            return False
        if plan.policy is not None:
            label, length = plan.policy["label"], plan.policy.get("turn_steps")
        else:  # the first candidate, the job's own policy until a switch
            first = trial["candidates"][0]
            label, length = first["label"], turn_steps(first, trial["steps"])
        if self._turn is None or self._turn[0] != label:
            self._turn = (label, self.step, False)
            return False
        if not length or self._turn[2] or self.step - self._turn[1] < length:
            return False
        self._turn = (label, self._turn[1], True)
        return True

    def _evaluates(self, plan: Plan) -> bool:
        """Who evaluates: every reporter, except that a background kind's rank 0 alone evaluates the
        replicas' newest average (the same on every member) for the job."""
        return self.algorithm.kind != "background" or plan.rank_of(self.slot) == 0

    def _evaluate(self) -> dict:
        evaluate = getattr(self.workload, "evaluate", None)
        data = getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        model, flat = self.model, self.impl.eval_parameters()
        if flat is not None:  # the replicas' average, on a copy of the model
            if self._eval_model is None:
                self._eval_model = copy.deepcopy(self.model)
            model = self._eval_model
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat.to(self.device), [p for p in model.parameters() if p.requires_grad])
        return {"metrics": metrics_of(evaluate, model, data, self.step)}

    def _final_eval(self) -> None:
        """The final model is evaluated once; the record updates status, not history."""
        if self.plan is not None and self.plan.rank_of(self.slot) == 0:
            self._records.append({"step": self.step, "time": time.time(), "final": True, **self._evaluate()})

    def _flush_report(self, force: bool = False, wait: bool | None = None) -> None:
        """Send the records gathered since the last report: every REPORT_EVERY_S, or now with `force`
        (waiting for the coordinator's answer unless `wait` is False). Rank 0's epoch agreement, if one is
        pending, goes first whatever the time: the coordinator takes a sender's calls in order, and history
        needs the agreed step and the records it lacked before any record of the new epoch."""
        if self._agreement is not None:
            agreement, self._agreement = self._agreement, None
            self.link.epoch_agreed(*agreement)
        now = time.monotonic()
        world = len(self.plan.members) if self.plan else 1
        if not force and now - self._last_report < max(REPORT_EVERY_S, world / REPORTS_PER_S):
            return
        self._last_report = now
        epoch = self.plan.membership_epoch if self.plan else 0
        progress = Progress(self.slot, self.step, epoch, time.time(), tuple(self._records), self.compute_s,
                            mark=self._mark(), step_s=tuple(self._step_s))
        self._records, self._step_s = [], []
        try:
            self.link.report(progress, wait=force if wait is None else wait)
        except Exception as err:  # noqa: BLE001 - a lost report must not kill training (records are kept)
            log.warning("progress report at step %d lost: %s", self.step, str(err).splitlines()[0][:200])


def crossed(every: int | None, before: int | None, now: int) -> bool:
    """Whether a multiple of `every` lies in (before, now]: commit points may jump several steps."""
    if not every:
        return False
    before = now - 1 if before is None else before
    return now // every > before // every
