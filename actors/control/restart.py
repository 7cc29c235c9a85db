"""What a restarted coordinator finds: the members that are still alive, and what they committed.

A formed group needs no coordinator, so the members of a dead incarnation train on. The new one
looks up each member the state file names (by its own actor name, or the spare's it adopted),
asks it for its status, and takes the live ones back with their newest plan (one published just
before the crash was never saved); joiners that were not admitted yet are killed (they start
again). Then it collects the records committed while nobody listened: every member keeps its
newest ones, and a record of the same step from two members is taken once.

`StateFile` is what the new incarnation carries on from: the state file (`coordinator.json`) that every
incarnation keeps saving with what it cannot re-learn from the live workers.

`resume` is the other way a run goes on: a new run that starts from a checkpoint (`--resume`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from actors.control.book import MembershipBook
from actors.control.job_state import JobStateMachine
from actors.control.journal import Journal
from actors.control.members import Member
from actors.control.run_identity import RunIdentity
from actors.control.workers import WorkerGroup
from algorithms.rules.supervision import JobState, MemberState

S = MemberState


class Started(Protocol):
    """A part that counts what it started (the launcher's workers)."""

    started: int


class Kept(Started, Protocol):
    """The spare pool: the spares it started, and the names of those it keeps now."""

    def names(self) -> list[str]: ...


class StateFile:
    """The state file: what a restarted incarnation cannot re-learn from the live workers (the book, the
    job's state, progress, spares, start counts), saved at each change; and, for a restarted incarnation,
    the one it found (`saved`) until it has re-attached its workers (`recovered`)."""

    def __init__(self, run: RunIdentity, journal: Journal, book: MembershipBook, job: JobStateMachine,
                 launcher: Started, spares: Kept, group: WorkerGroup, saved: dict[str, Any] | None) -> None:
        """`saved`: the state file a restarted incarnation found (None for the first one)."""
        self._run, self._journal, self._book, self._job, self._group = run, journal, book, job, group
        self._launcher, self._spares = launcher, spares
        self.saved = saved
        self.recovered = asyncio.Event()
        """Set once a restarted incarnation has re-attached its workers (at once for the first one):
        `scale` waits for it, since Ray may hand a restarted coordinator a call the dead one had taken."""
        if saved is None:
            self.recovered.set()

    def save(self) -> int:
        """The coordinator's state to the state file's writer (off the event loop); the snapshot's number."""
        state = self._book.snapshot()
        spares = self._spares.names()
        saved = self.saved
        if saved is not None and not self.recovered.is_set():  # restarted, not re-attached: the dead incarnation's workers stand
            state["members"], spares = saved["members"], [*saved.get("spares", ()), *spares]
        state.update({"incarnation": self._run.incarnation, **self._job.snapshot(), "loss": self._journal.loss,
                      "metrics": dict(self._journal.metrics), "spares": spares, "started_workers": self._launcher.started,
                      "started_spares": self._spares.started})
        return self._journal.save_state(state)

    def ended(self, state: JobState, number: int) -> None:
        """The job ended in `state`: snapshot `number` (which holds it) on disk before the driver, told the
        job ended, reads it; and the job's record in Ray's key-value store."""
        self._journal.wait_saved(number, 30)
        self._group.publish_record(self._run.name, self._run.end_record(state.value))


async def reattach(saved: dict[str, Any], book: MembershipBook, group: WorkerGroup, prefix: str,
                   watch: Callable[[Member], None]) -> tuple[list[str], list[str], list[int]]:
    """The saved members into the book: (re-attached slots, slots found gone, the membership epochs
    the live ones hold). Each re-attached member is watched again; the book's plan becomes the newest
    any member holds."""
    for name in saved.get("spares", ()):  # the dead incarnation's spares: new ones are started
        group.kill(group.lookup(name))
    found, lost, epochs = [], [], []
    for slot, was in saved["members"].items():
        handle = group.lookup(was.get("actor_name") or f"{prefix}/{slot}")
        if was["state"] not in (S.TRAINING.value, S.LEAVING.value):  # a joiner not admitted yet: started again
            group.kill(handle)
            continue
        info = await group.status(handle) if handle is not None else None
        member = Member(slot, handle, pid=was["pid"], node=was["node"], node_id=was["node_id"], state=S(was["state"]),
                        store_port=info.store_port if info else was.get("store_port", 0),
                        incarnation=was.get("incarnation", 0), actor_name=was.get("actor_name", ""),
                        # a joiner waiting for the state, unless it loaded one meanwhile
                        holds_state=was.get("holds_state", True) or bool(info and info.holds_state))
        book.members[slot] = member
        if info is None:
            member.ends_before_training(S.DEAD, "gone while the coordinator was down")
            book.depart(member, group.actor_id(handle))
            lost.append(slot)
            continue
        found.append(slot)
        newest = info.plan
        if newest is not None:
            epochs.append(newest.membership_epoch)
            book.adopt(newest)  # published just before the crash, never saved
        watch(member)
    return found, lost, epochs


async def records_since(slots: list[str], book: MembershipBook, group: WorkerGroup, step: int) -> list[dict]:
    """The records after `step` that the members kept, each (step, slot) once, in step order."""
    kept: dict[tuple, dict] = {}
    for slot in slots:
        for record in await group.records_after(book.members[slot].handle, step) or ():
            kept.setdefault((record["step"], record.get("slot", "")), record)
    return [kept[key] for key in sorted(kept)]


async def resume(path: str, first: Member, group: WorkerGroup, server: Any, history: Any, journal: Any) -> None:
    """`--resume`: the checkpoint at `path` into the first member (or the parameter server, whose
    state it is for the server kinds); history and progress go on from its step."""
    try:
        data = await journal.checkpoints.read(path)
    except RuntimeError as err:
        raise RuntimeError(f"cannot resume from {path}: {err}") from None
    if server is not None:
        step = await server.load_checkpoint(data)
    else:
        step = await group.load_checkpoint(first.handle, data)
    journal.set_step(step)
    history.resume_at(step)
    journal.event("info", f"resumed from checkpoint at step {step} ({path})", checkpoint=str(path), step=step)
