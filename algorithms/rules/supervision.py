"""What the coordinator does when a member ends, a stop is asked for, or it restarts. Pure: no Ray.

The coordinator builds a frozen `JobView` of what it knows, hands it and the event to `decide`,
and carries out the `Decision` it gets back (abort the epoch, publish a plan, start
replacements, change state). Keeping the deciding apart from the doing means every rule below
is tested in milliseconds (`tests/unit/test_supervision.py`), and each decision says why in
one sentence.

The rules:
- A member that finishes while leaving has left; once every member of the plan has finished at
  the same step, the job ends.
- A member that ends on a bad training sample (a `DataFault`: the data's own error, the same at every
  try) fails the job, whatever `workers.on_failure` says: no failure is counted, no slot retired, no
  replacement started, no pause; the survivors agree on the newest committed step and stop there (the
  job then FAILS with that state saved and the sample's one line as its cause).
- A member that ends on a mistake in the workload's own code (a `WorkloadFault`: its factory, loss or
  `evaluate` raised, or returned what the workload contract refuses) fails the job the same way once it
  is a bug in the workload (`workload_bug`): a value the contract refuses at once; an exception once the
  same one (call, type, the user's file and line) came from another member, or from the slot's previous
  worker at the same step. A first exception may be the worker's own trouble (memory, a file system, a
  signal): it is handled as any failure below.
- A member that dies, raises or hangs aborts the epoch at once. Its slot counts a failure and is
  retired past `workers.failure_budget`. With `on_failure: fail` the survivors agree on the newest
  committed step and stop (the job then FAILS with that state saved). Otherwise the survivors are
  re-formed without waiting for a replacement while they are at least `workers.min`, and the job
  PAUSES below it; a replacement is started unless a stop was decided. A stop survives every
  reshape, and needs no minimum. With no survivor the committed state is gone: the job FAILS.
- A stop re-forms the live members (a new membership epoch if the plan still names a dead one)
  with a stop step: the next step, or, while PAUSED, the committed step they hold. With no live
  member (during start-up) the job ends at once.
- A restarted coordinator publishes a membership epoch newer than any a worker holds.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from core.schema import OrchestratorError


class JobState(str, enum.Enum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RESHAPING = "RESHAPING"
    PAUSED = "PAUSED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FINISHED = "FINISHED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.STOPPED, JobState.FINISHED, JobState.FAILED)

    @property
    def active(self) -> bool:
        """Training or able to: scale requests and replacements apply."""
        return self in (JobState.RUNNING, JobState.RESHAPING, JobState.PAUSED)


class MemberState(str, enum.Enum):
    STARTING = "starting"
    """Its actor is being created (placed or waiting for room)."""
    READY = "ready"
    """Started (imports done, workload built), not yet in a plan."""
    TRAINING = "training"
    LEAVING = "leaving"
    """Dropped by a scale-down plan; finishes cleanly."""
    LEFT = "left"
    FINISHED = "finished"
    DEAD = "dead"
    FAILED = "failed"
    HUNG = "hung"
    RETIRED = "retired"
    STOPPED = "stopped"

    @property
    def departed(self) -> bool:
        return self in DEPARTED

    @property
    def live(self) -> bool:
        """Takes part in plans (a leaving member still gets the plan that drops it)."""
        return self in (MemberState.TRAINING, MemberState.READY, MemberState.LEAVING)


DEPARTED = frozenset({MemberState.DEAD, MemberState.FAILED, MemberState.HUNG, MemberState.RETIRED, MemberState.LEFT})


class IllegalTransition(OrchestratorError):
    """A job or a member asked to move to a state its transition table does not allow from where it is."""


def _table(rows: dict) -> dict:
    return {state: frozenset(targets) | {state} for state, targets in rows.items()}  # staying is always allowed


_J = JobState
_ENDED = tuple(s for s in JobState if s.terminal)
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = _table({
    _J.STARTING: (_J.RUNNING, _J.PAUSED, _J.STOPPING, *_ENDED),
    _J.RUNNING: (_J.RESHAPING, _J.PAUSED, _J.STOPPING, *_ENDED),
    _J.RESHAPING: (_J.RUNNING, _J.PAUSED, _J.STOPPING, *_ENDED),
    _J.PAUSED: (_J.STARTING, _J.RUNNING, _J.RESHAPING, _J.STOPPING, *_ENDED),  # STARTING: placed at last, still starting
    _J.STOPPING: _ENDED,
    _J.STOPPED: (), _J.FINISHED: (), _J.FAILED: (),
})
"""Where a job may go from each state (the coordinator's `transition` is the one place it moves): nothing
leaves an ended state, a stopping job only ends, and only a paused start goes back to STARTING."""

_M = MemberState
_GONE = (*sorted(DEPARTED), _M.FINISHED, _M.STOPPED)  # every way a member ends
MEMBER_TRANSITIONS: dict[MemberState, frozenset[MemberState]] = _table({
    _M.STARTING: (_M.READY, *_GONE),
    _M.READY: (_M.TRAINING, _M.LEAVING, *_GONE),
    _M.TRAINING: (_M.LEAVING, *_GONE),
    _M.LEAVING: _GONE,
    _M.LEFT: (_M.RETIRED,), _M.DEAD: (_M.RETIRED,), _M.FAILED: (_M.RETIRED,), _M.HUNG: (_M.RETIRED,),
    _M.FINISHED: (_M.STOPPED,),
    _M.RETIRED: (), _M.STOPPED: (),
})
"""Where a member may go from each state (`Member.move` is the one place it moves): forward through
starting, ready, training and leaving, never back; a member that ended never comes back (its slot gets
a new member); an ended one can still be retired (its failure spent the slot's budget)."""


def check_transition(table: dict, now: enum.Enum, to: enum.Enum, who: str) -> None:
    """IllegalTransition unless `table` lets `now` move to `to`."""
    if to not in table[now]:
        raise IllegalTransition(f"{who} cannot go from {now.value} to {to.value} (allowed: "
                                f"{', '.join(sorted(s.value for s in table[now])) or 'none'})")


@dataclass(frozen=True)
class JobView:
    """What the coordinator knows when it decides."""

    state: JobState
    plan_members: tuple[str, ...]
    """The current plan's members in rank order (empty before the first plan)."""
    members: Mapping[str, MemberState]
    failures: Mapping[str, int] = field(default_factory=dict)
    min_workers: int = 1
    failure_budget: int = 3
    on_failure: str = "reshape"
    stop_kind: str | None = None
    """STOPPED / FINISHED / FAILED once a stop is decided."""
    stateless: frozenset = frozenset()
    """Joiners admitted to a plan that have not received the committed state yet: they train on only
    with a member that holds it (alone they would start over from their initial model)."""
    checkpoint_step: int | None = None
    """The step of the run's newest checkpoint, for the kinds whose members hold the state (None: none)."""
    workload_faults: tuple[tuple[str, WorkloadFault], ...] = ()
    """The workload faults met before, each with its slot, oldest first (`workload_bug` compares with them)."""

    def training(self, *, besides: str = "") -> tuple[str, ...]:
        """The plan's members that are training, in rank order."""
        return tuple(s for s in self.plan_members if s != besides and self.members.get(s) == MemberState.TRAINING)

    def holders(self, *, besides: str = "") -> tuple[str, ...]:
        """The training members that hold the committed state."""
        return tuple(s for s in self.training(besides=besides) if s not in self.stateless)


# ------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class DataFault:
    """A training sample that cannot be trained (it raises when read, or its shape or dtype differs
    from its batch's): what a worker's outcome carries to the coordinator when its run ended on one."""

    sample: str
    """Which: "sample 17", "rows 40..59 (Ray Data block 3)"."""
    error: str
    """Why, in one line: "ValueError: corrupt record 17"."""

    @property
    def line(self) -> str:
        return f"bad training {self.sample}: {self.error}"


@dataclass(frozen=True)
class WorkloadFault:
    """A mistake in the workload's own code: its factory, its `loss` (the model's forward with it) or its
    `evaluate` raised, or returned what the workload contract refuses (a loss that is not a scalar, a
    metric that is not a number). What a worker's outcome, or its failed start, carries to the coordinator."""

    kind: str
    """Which call: "factory", "loss" or "evaluate"."""
    type: str
    """The exception's type ("RuntimeError"); "" for a value the contract refuses."""
    message: str
    """Its message's first line; for a refused value, what is wrong and how to fix it."""
    where: str
    """The user's file and line ("/home/me/model.py:41"): the innermost frame of the traceback in the
    workload's own code; for a refused value, where the function that returned it is defined. "" if none."""
    traceback: str = ""
    step: int | None = None
    """The step it trained or evaluated; None at the start (the factory)."""

    @property
    def certain(self) -> bool:
        """A value the contract refuses: every try returns it again."""
        return not self.type

    @property
    def signature(self) -> tuple[str, str, str]:
        """What makes two faults the same failure: the call, the type and the user's file and line."""
        return self.kind, self.type, self.where

    @property
    def line(self) -> str:
        at = f"workload.{self.kind}" if self.type else ""
        if self.where:
            at = f"{at} at {self.where}" if at else self.where
        if self.step is not None:
            at = f"{at}, step {self.step}" if at else f"step {self.step}"
        what = f"{self.type}: {self.message}" if self.type else self.message
        return f"{what} ({at})" if at else what


def workload_bug(fault: WorkloadFault, slot: str, earlier: Sequence[tuple[str, WorkloadFault]]) -> str | None:
    """The job's cause when `slot`'s `fault` is a bug in the workload rather than a failure of its worker,
    given the faults met `earlier` (slot, fault); None for a first exception, which may be the worker's
    own trouble."""
    if fault.certain:
        return fault.line
    where = f"traceback: workers/{slot}.log"
    for other_slot, other in earlier:
        if other.signature != fault.signature:
            continue
        if other_slot != slot:
            return f"{fault.line}; the same in {other_slot} and {slot}: a bug in the workload [{where}]"
        if other.step == fault.step:
            at = "its start" if fault.step is None else f"step {fault.step}"
            return f"{fault.line}; the same again in {slot}'s next worker at {at}: a bug in the workload [{where}]"
    return None


@dataclass(frozen=True)
class MemberEnded:
    """A member's `run()` returned (`finished`), raised (`error`) or its process died (`died`)."""

    slot: str
    outcome: str
    cause: str = ""
    detector: str = ""
    """actor death / task error / heartbeat / step progress / collective failure ..."""
    hung: bool = False
    """The coordinator evicted it for hanging (heartbeat, step progress)."""
    data_fault: DataFault | None = None
    """Its run raised on a bad training sample: every try would meet it again."""
    workload_fault: WorkloadFault | None = None
    """Its run ended on a mistake in the workload's own code."""


@dataclass(frozen=True)
class StopRequested:
    kind: str
    """STOPPED (asked), FINISHED (target or time limit reached) or FAILED (a target no evaluation has)."""
    reason: str


Event = MemberEnded | StopRequested


# ------------------------------------------------------------------------------------ decisions
@dataclass(frozen=True)
class Decision:
    reason: str
    member: tuple[str, MemberState] | None = None
    """The ended member's new state."""
    abort: bool = False
    """Abort the current membership epoch on every member (their pending collectives fail now)."""
    publish: tuple[str, ...] | None = None
    """Publish a plan with these members (a new membership epoch when they differ)."""
    new_epoch: bool = False
    """Publish as a new membership epoch even if the members are the same."""
    transition: JobState | None = None
    stop_kind: str | None = None
    """Set when this decision decides a stop."""
    stop_step: str | None = None
    """"next" (the coordinator's step + 1) or "held" (0: the committed step the members hold)."""
    count_failure: bool = False
    """Count a failure against the member's slot."""
    retire: bool = False
    """The slot's budget is spent: retire it."""
    replace: bool = False
    """Start workers until the membership matches the scale target again."""
    finish: bool = False
    """Every member finished: keep the model and end the job."""
    end_now: JobState | None = None
    """End the job at once in this state (nothing to save, or nothing left to save it from)."""
    restore: bool = False
    """No live member holds the state: start fresh members from the newest checkpoint (the steps since
    it are redone)."""
    ignore: bool = False
    failure: str | None = None
    """Where this decision fails the job: its cause, when that is not the event's (a bug in the workload:
    the fault's line and why it is a bug)."""


def decide(view: JobView, event: Event) -> Decision:
    if isinstance(event, StopRequested):
        return _on_stop(view, event)
    return _on_member_ended(view, event)


def _on_member_ended(view: JobView, e: MemberEnded) -> Decision:
    state = view.members.get(e.slot)
    if state is None or state.departed:
        return Decision(f"{e.slot} was already handled", ignore=True)
    if e.outcome == "finished":
        if state == MemberState.LEAVING:
            return Decision(f"{e.slot} left after the scale-down", member=(e.slot, MemberState.LEFT))
        # A joiner still waiting for the state cannot carry the job on: once every member that holds
        # it finished, so did the job (the joiner's plan came too late to be adopted).
        done = all(view.members.get(s) == MemberState.FINISHED or s == e.slot or s in view.stateless
                   for s in view.plan_members)
        return Decision(f"{e.slot} finished", member=(e.slot, MemberState.FINISHED), finish=done and bool(view.plan_members))
    if state in (MemberState.LEAVING, MemberState.STOPPED):
        return Decision(f"{e.slot} was on its way out", member=(e.slot, MemberState.LEFT))
    ended = MemberState.HUNG if e.hung else (MemberState.DEAD if e.outcome == "died" else MemberState.FAILED)
    others = tuple(s for s in view.plan_members if s != e.slot and s not in view.stateless)
    if others and all(view.members.get(s) == MemberState.FINISHED for s in others):
        return Decision(f"{e.cause}; every other member had finished", member=(e.slot, ended), finish=True)
    survivors = view.training(besides=e.slot)  # joiners waiting for the state too: they get it in the new epoch
    if e.data_fault is not None:
        return _fail_job(view, e, ended, survivors, e.data_fault.line)
    bug = workload_bug(e.workload_fault, e.slot, view.workload_faults) if e.workload_fault is not None else None
    if bug is not None:
        return _fail_job(view, e, ended, survivors, bug)
    if not view.holders(besides=e.slot) and any(m == MemberState.FINISHED and s not in view.stateless
                                                 for s, m in view.members.items()):
        return Decision(f"{e.cause}; the members that hold the state had finished", member=(e.slot, ended), finish=True)
    if not view.holders(besides=e.slot) and view.checkpoint_step is not None and view.on_failure != "fail" \
            and view.stop_kind is None:
        retire = view.failures.get(e.slot, 0) + 1 >= view.failure_budget
        return Decision(f"{e.cause}; no live worker holds the committed state: fresh workers start from the "
                        f"checkpoint at step {view.checkpoint_step}", member=(e.slot, ended), abort=True,
                        count_failure=True, retire=retire, replace=True, restore=True,
                        transition=JobState.PAUSED if view.state.active else None)
    if not view.holders(besides=e.slot):
        # a resume is advised where it helps: not for the workload's own exception, which a resume meets again
        why = e.cause if view.on_failure == "fail" else f"{e.cause}; no live worker holds the committed state any more" + (
            "" if e.workload_fault is not None else " (resume with --resume)")
        return Decision(why, member=(e.slot, ended), abort=True, end_now=JobState.FAILED)
    if view.on_failure == "fail":
        return Decision(f"{e.cause}; workers.on_failure = fail: the survivors agree on the newest committed step "
                        f"and stop there", member=(e.slot, ended), abort=True, publish=survivors,
                        transition=JobState.STOPPING if view.stop_kind != "FAILED" else None,
                        stop_kind="FAILED", stop_step="held")
    retire = view.failures.get(e.slot, 0) + 1 >= view.failure_budget
    stopping = view.stop_kind is not None
    if len(survivors) >= view.min_workers or stopping:
        return Decision(e.cause, member=(e.slot, ended), abort=True, count_failure=True, retire=retire,
                        publish=survivors, replace=not stopping,
                        transition=JobState.RESHAPING if view.state in (JobState.RUNNING, JobState.PAUSED) else None)
    return Decision(f"{len(survivors)} live workers, below workers.min = {view.min_workers}: waiting for replacements",
                    member=(e.slot, ended), abort=True, count_failure=True, retire=retire, replace=True,
                    transition=JobState.PAUSED)


def _fail_job(view: JobView, e: MemberEnded, ended: MemberState, survivors: tuple[str, ...], line: str) -> Decision:
    """A bad sample, or a bug in the workload, ends the job: a replacement, a restart from a checkpoint or
    a retry would meet it again. The survivors stop at the step they hold (nothing committed is lost);
    with none, at once. No failure is counted: the slot did nothing wrong."""
    if not view.holders(besides=e.slot):
        return Decision(line, member=(e.slot, ended), abort=True, end_now=JobState.FAILED, failure=line)
    return Decision(line, member=(e.slot, ended), abort=True, publish=survivors,
                    transition=JobState.STOPPING if view.stop_kind != "FAILED" else None,
                    stop_kind="FAILED", stop_step="held", failure=line)


def _on_stop(view: JobView, e: StopRequested) -> Decision:
    if view.state.terminal or view.stop_kind is not None:
        return Decision("a stop is already under way", ignore=True)
    live = view.training()
    if not view.plan_members or not live:
        return Decision(f"{e.reason}; no worker was training", stop_kind=e.kind, end_now=JobState(e.kind))
    held = view.state == JobState.PAUSED  # training is held: stop at the step the members hold
    return Decision(e.reason, stop_kind=e.kind, publish=live, stop_step="held" if held else "next",
                    transition=JobState.STOPPING if view.state.active else None)


def recovered_epoch(saved_epoch: int, worker_epochs: list[int], server_epoch: int = 0) -> int:
    """The membership epoch a restarted coordinator publishes next: newer than any a worker holds
    (a plan published just before the crash may have been sent but never saved) and than the
    parameter server's (told before the plan goes out; it ignores a membership that is not newer)."""
    return max([saved_epoch, *worker_epochs, server_epoch]) + 1
