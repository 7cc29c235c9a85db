"""What a replica tells its coordinator: a history record for each commit point (with the
evaluation's metrics where one is due), sent in batches at most every REPORT_EVERY_S; rank 0's epoch
agreement; and the checkpoints rank 0 hands over at their steps.

`StepReporter` turns the replica's typed `StepRecord`s into the history records its reports carry, and keeps
the newest of them (a departed rank 0's unreported steps, a restarted coordinator's gap). A report lost
on the way is logged and never stops training.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from actors.faults import WorkerFaults
from actors.observe.peaks import peak_flops
from actors.plan import Plan, Progress, turn_steps, worker_tokens
from actors.training.checkpoint_writer import Checkpoint, CheckpointWriter
from actors.training.evaluation import Evaluation
from algorithms.policies.base import Algorithm, AlgorithmImpl
from core.schema import JobConfig

log = logging.getLogger(__name__)

REPORT_EVERY_S = 0.25
REPORTS_PER_S = 2000.0
"""The coordinator's share of reports: a member reports every REPORT_EVERY_S, or less often in a job
so large that all of them together would send more than this many per second (Ray's own figure for
calls into one async actor from one caller is 4,100-4,800 per second; see docs/control-plane.md)."""
CHECKPOINT_STORED_S = 300.0
"""How long the end of a run waits for its last checkpoint to be stored (a large upload)."""
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


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One commit point as the replica saw it; `StepReporter.record` makes it the history record."""

    step: int
    loss: float
    plan: Plan
    micro_steps: int
    bytes_sent: int
    lr: float
    step_time: float
    wait_s: float
    samples: int
    prev: int | None
    """The step of the previous record this member kept (None: none yet)."""
    provisional: bool
    """The policy holds local steps until its rounds (the record says which steps the round covered)."""
    step_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    policy_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    dropped: int = 0
    skipped: int = 0
    grad_norm: float | None = None
    """The gradient's norm before clipping, where the update measured it (clipping, a loss scale)."""
    skipped_updates: int = 0
    """Updates skipped so far because their gradient was not finite (fp16-mixed)."""
    tensor_bytes: dict[str, int] | None = None
    """With replica groups, at an epoch's first commit: what this member holds of the training state (bytes)."""
    time: float = dataclasses.field(default_factory=time.time)


class TrialTurn:
    """`sync.auto`'s trial as a member sees it: the policy running and the first step it committed."""

    def __init__(self, trial: dict) -> None:
        self._trial = trial
        self._turn: tuple[str, int, bool] | None = None
        """(the policy's label, the first step it committed, whether its turn's last step was reported at once)."""

    def ends(self, plan: Any, step: int, reports: bool) -> bool:
        """Whether `step` ends a turn: the policy running has committed its turn's steps (`turn_steps`)
        since its first. The turn's last record then goes to the coordinator at once, not up to
        REPORT_EVERY_S later, so the trial moves on without running the candidate for longer."""
        if not self._trial or not reports:
            return False
        if plan.policy is not None:
            label, length = plan.policy["label"], plan.policy.get("turn_steps")
        else:  # the first candidate, the job's own policy until a switch
            first = self._trial["candidates"][0]
            label, length = first["label"], turn_steps(first, self._trial["steps"])
        if self._turn is None or self._turn[0] != label:
            self._turn = (label, step, False)
            return False
        if not length or self._turn[2] or step - self._turn[1] < length:
            return False
        self._turn = (label, self._turn[1], True)
        return True


class StepReporter:
    """A member's history records, reports, evaluations and checkpoints."""

    def __init__(self, cfg: JobConfig, slot: str, link: Link, workload: Any, faults: WorkerFaults,
                 device: torch.device, tokens_per_sample: int, compute_dtype: torch.dtype = torch.float32) -> None:
        self._cfg = cfg
        self._slot = slot
        self._link = link
        self._faults = faults
        self._tokens_per_sample = tokens_per_sample
        self._flops_per_token: float | None = getattr(workload, "flops_per_token", None)
        self._peak = peak_flops(device, compute_dtype)[0] if self._flops_per_token else None
        """The device's dense peak in the dtype the step computes in (actors/observe/peaks.py): None on a
        CPU unless the environment gives one, and then no record says its MFU."""
        self.kept: deque[dict] = deque(maxlen=KEEP_RECORDS)
        """History records of this replica's newest commit points (every member keeps them)."""
        self._records: list[dict] = []
        self._agreement: tuple[int, int, tuple[dict, ...]] | None = None
        """Rank 0's epoch agreement (epoch, agreed step, records after the plan's history step), sent
        ahead of its next report (`flush`): after the epoch's first commit, off the re-form's path."""
        self._last_report = 0.0
        self._turn = TrialTurn(cfg.policy_trial)
        self.evaluation = Evaluation(workload, device)
        self.checkpoints = CheckpointWriter(link.save_checkpoint)
        background = cfg.checkpoint.background
        self._background = device.type == "cuda" if background is None else background
        """Rank 0's checkpoints are serialized in a thread from a host copy (actors/training/checkpoint_writer.py)."""
        self._evaluated: tuple[int, dict] | None = None
        """The newest evaluation this member recorded: (its step, {"metrics": ...})."""
        self.compute_s = 0.0
        """EWMA of this member's compute time per step (forward and backward)."""
        self._step_s: list[float] = []

    def newest(self) -> dict | None:
        return self.kept[-1] if self.kept else None

    def keep(self, record: dict | None) -> None:
        """A state's record, loaded with it: kept where it is newer than this member's newest."""
        if record is not None and (not self.kept or self.kept[-1]["step"] < record["step"]):
            self.kept.append(record)

    def after(self, step: int) -> tuple[dict, ...]:
        """The kept records of commit points after `step`."""
        return tuple(r for r in list(self.kept) if r["step"] > step)

    def timed(self, spent: float) -> None:
        """A step's compute took `spent` seconds."""
        self.compute_s = 0.9 * self.compute_s + 0.1 * spent if self.compute_s else spent
        self._step_s.append(spent)

    def agree(self, epoch: int, step: int, history_step: int) -> None:
        """Rank 0 entered epoch `epoch` at committed step `step`: history takes it, and the records it lacks
        (after `history_step`), ahead of this member's next report."""
        self._agreement = (epoch, step, self.after(history_step))

    def reports(self, plan: Plan, algorithm: Algorithm) -> bool:
        rank = plan.rank_of(self._slot)
        return algorithm.reporter.reports_from(-1 if rank is None else rank)

    def record(self, rec: StepRecord, algorithm: Algorithm, model: torch.nn.Module, impl: AlgorithmImpl,
               progress: Callable[[], tuple[int, int]], evaluated: dict | None = None) -> None:
        """Keep the history record of `rec`, evaluate where due (`evaluated`: the members' evaluation in
        shares, taken already), and report if it is time. `progress()`: (step, mark) for the report."""
        plan = rec.plan
        record: dict[str, Any] = {
            "step": rec.step, "time": rec.time, "loss": rec.loss, "world_size": len(plan.members),
            "global_batch": plan.global_batch, "micro_steps": rec.micro_steps, "membership_epoch": plan.membership_epoch,
            "bytes_sent": rec.bytes_sent, "lr": rec.lr, "step_time": rec.step_time, "wait_s": rec.wait_s}
        if rec.step_metrics:  # the workload's step metrics, aggregated as the loss is
            record["step_metrics"] = dict(rec.step_metrics)
        if plan.policy is not None:  # switched mid-run: which policy committed it (the trial measures each)
            record["policy"] = plan.policy["label"]
        if rec.provisional:
            record.update(prev=rec.prev if rec.prev is not None else 0, samples=rec.samples)
        if algorithm.reporter.each_member_reports:
            record.update(slot=self._slot, samples=rec.samples)
        record.update(rec.policy_fields)
        if self._tokens_per_sample:  # the step's tokens: the global batch's, or this member's own (per-member kinds)
            record["tokens"] = int(record.get("samples", plan.global_batch)) * self._tokens_per_sample
            compute = rec.step_time - rec.wait_s
            if self._peak and self._flops_per_token and compute > 0:  # one worker's tokens over its compute
                record["mfu"] = worker_tokens(record) * self._flops_per_token / (compute * self._peak)
        if rec.dropped:
            record["dropped_samples"] = rec.dropped
        if rec.skipped:
            record["skipped_samples"] = rec.skipped
        if rec.grad_norm is not None:
            record["grad_norm"] = rec.grad_norm
        if rec.skipped_updates:
            record["skipped_updates"] = rec.skipped_updates
        if rec.tensor_bytes:
            record["tensor_bytes"] = dict(rec.tensor_bytes)
        self.kept.append(record)
        reports = self.reports(plan, algorithm)
        if reports:
            if evaluated is None and self._evaluates(plan, algorithm) and self.evaluation_due(rec.prev, rec.step):
                evaluated = self.evaluation.whole(model, impl, rec.step)
            if evaluated:
                record.update(evaluated)
                self._evaluated = (rec.step, evaluated)
            self._records.append(record)
        self.flush(plan, *progress(), force=self._turn.ends(plan, rec.step, reports), wait=False)

    def _evaluates(self, plan: Plan, algorithm: Algorithm) -> bool:
        """Who evaluates: every reporter, except that a background kind's rank 0 alone evaluates the
        replicas' newest average (the same on every member) for the job."""
        return not algorithm.kind.background_rounds or plan.rank_of(self._slot) == 0

    def evaluation_due(self, prev: int | None, step: int) -> bool:
        """Whether the commit point `step` (the one before it: `prev`) crosses a multiple of `eval_every`."""
        return self.evaluation.offered and crossed(self._cfg.eval_every, prev if prev is not None else step - 1, step)

    def final(self, plan: Plan | None, model: torch.nn.Module, impl: AlgorithmImpl, step: int,
              evaluated: dict | None = None) -> None:
        """The final model is evaluated once (`evaluated`: already, by the members that hold it together);
        the record updates status, not history."""
        if plan is not None and plan.rank_of(self._slot) == 0:
            metrics = self._final_evaluation(model, impl, step) if evaluated is None else evaluated
            self._records.append({"step": step, "time": time.time(), "final": True, **metrics})

    def _final_evaluation(self, model: torch.nn.Module, impl: AlgorithmImpl, step: int) -> dict:
        """The final model's metrics: those of the evaluation at this same step, where one was just taken
        (not where it evaluated the replicas' average, which background rounds move without a step)."""
        if self._evaluated is not None and self._evaluated[0] == step and impl.eval_parameters() is None:
            return self._evaluated[1]
        return self.evaluation.whole(model, impl, step)

    def maybe_checkpoint(self, plan: Plan, algorithm: Algorithm, prev: int | None, step: int, mark: int,
                         checkpoint: Callable[[bool], Checkpoint]) -> None:
        """Rank 0 hands the committed state to the coordinator at each `checkpoint.every_steps`
        (`checkpoint(background)`: the state at this step, copied to the host where it is written in the background)."""
        if not self.checkpoint_due(algorithm, prev, step):
            return
        self._faults.maybe_fire("checkpoint", step)
        if plan.rank_of(self._slot) == 0:
            self.flush(plan, step, mark, force=True)  # history up to this step precedes the checkpoint
            self.checkpoints.submit(step, checkpoint(self._background))

    def checkpoint_due(self, algorithm: Algorithm, prev: int | None, step: int) -> bool:
        """Whether the commit point `step` (the one before it: `prev`) crosses a multiple of
        `checkpoint.every_steps` (never for the kinds whose server checkpoints the state)."""
        return not algorithm.final_model.from_server and crossed(self._cfg.checkpoint.every_steps, prev, step)

    def await_checkpoints(self) -> None:
        """A run ends once the checkpoints it sent are stored: the coordinator stores them off its event
        loop while it goes on, and one sent at the last step (an upload, to an object store) was cut
        off when the job ended and its coordinator exited (CI, S3: step 120's data without its manifest)."""
        try:
            self.checkpoints.wait()
            self._link.checkpoints_stored(CHECKPOINT_STORED_S)
        except Exception as err:  # noqa: BLE001 - the coordinator is gone or slow: the run ends regardless
            log.warning("the checkpoint sent last may not be stored: %s", str(err).splitlines()[0][:200])

    def flush(self, plan: Plan | None, step: int, mark: int, force: bool = False, wait: bool | None = None) -> None:
        """Send the records gathered since the last report: every REPORT_EVERY_S, or now with `force`
        (waiting for the coordinator's answer unless `wait` is False). Rank 0's epoch agreement, if one is
        pending, goes first whatever the time: the coordinator takes a sender's calls in order, and history
        needs the agreed step and the records it lacked before any record of the new epoch."""
        if self._agreement is not None:
            agreement, self._agreement = self._agreement, None
            self._link.epoch_agreed(*agreement)
        now = time.monotonic()
        world = len(plan.members) if plan else 1
        if not force and now - self._last_report < max(REPORT_EVERY_S, world / REPORTS_PER_S):
            return
        self._last_report = now
        epoch = plan.membership_epoch if plan else 0
        progress = Progress(self._slot, step, epoch, time.time(), tuple(self._records), self.compute_s,
                            mark=mark, step_s=tuple(self._step_s))
        self._records, self._step_s = [], []
        try:
            self._link.report(progress, wait=force if wait is None else wait)
        except Exception as err:  # noqa: BLE001 - a lost report must not kill training (records are kept)
            log.warning("progress report at step %d lost: %s", step, str(err).splitlines()[0][:200])


def crossed(every: int | None, before: int | None, now: int) -> bool:
    """Whether a multiple of `every` lies in (before, now]: commit points may jump several steps."""
    if not every:
        return False
    before = now - 1 if before is None else before
    return now // every > before // every
