"""The job's state machine: where the job is, why, which stop is decided, and when it ran.

States (an enum in algorithms/rules/supervision.py): STARTING -> RUNNING -> (RESHAPING -> RUNNING)* ->
STOPPED / FINISHED / FAILED, with PAUSED below `workers.min`. A transition that `JOB_TRANSITIONS` does not
allow is refused (`check_transition` raises), never made; each one is an event with its reason and is
saved in the state file (actors/control/restart.py `StateFile`); a terminal one is on disk, and announced
in Ray's key-value store, before `transition` returns. This object is the only writer of the state, of
the cause `status` shows, of the kind of stop decided, and of the job's times; the others ask it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from algorithms.rules.supervision import JOB_TRANSITIONS, JobState, check_transition


class JobStateMachine:
    """The job's state, its cause, the stop decided and its times; its transitions, checked and recorded."""

    def __init__(self, name: str, started_at: float, note: Callable[..., Any], persist: Callable[[], int],
                 ended: Callable[[JobState, int], None], saved: dict | None = None) -> None:
        """`note(kind, reason, **detail)`: the journal's event; `persist()`: save the coordinator's state (returns
        the snapshot's number); `ended(state, number)`: a terminal state, once snapshot `number` holds it;
        `saved`: a restarted incarnation's state file, which it carries on from."""
        self.name = name
        self._note, self._persist, self._ended = note, persist, ended
        self.state = JobState.STARTING
        self.cause: str | None = None
        """Why the job is where it is (a pause, a stop, a failure), shown in status."""
        self.stop_kind: str | None = None
        """The state a decided stop ends in (STOPPED, FINISHED, FAILED): no worker starts once it is set."""
        self.started_at = started_at
        """When `start()` was called (the job's run time counts from there)."""
        self.ended_at: float | None = None
        self.running_since: float | None = None
        if saved is not None:
            self.state, self.stop_kind, self.cause = JobState(saved["state"]), saved["stop_kind"], saved["cause"]
            self.running_since, self.started_at = saved["running_since"], saved["started_at"]

    def snapshot(self) -> dict[str, Any]:
        """What the state file keeps of it."""
        return {"state": self.state.value, "stop_kind": self.stop_kind, "cause": self.cause,
                "started_at": self.started_at, "running_since": self.running_since}

    def may_start(self) -> bool:
        """Whether workers and spares start now: not once a stop is decided or the job ended."""
        return not self.state.terminal and self.stop_kind is None

    def set_cause(self, cause: str | None) -> None:
        self.cause = cause

    def running(self) -> None:
        """The first members run: the job's run time (`stop.time_s`) counts from now."""
        self.running_since, self.cause = time.time(), None

    def decide_stop(self, kind: str | None, cause: str | None = None) -> None:
        """A stop that ends in `kind` is decided (with its cause, when it has one to show)."""
        self.stop_kind = kind
        if cause is not None:
            self.cause = cause

    def transition(self, to: JobState, reason: str, persist: bool = True, **detail: Any) -> None:
        """Move to `to` (refused when not allowed), as an event; saved unless `persist` is False (a caller
        that saves right after), and always when terminal."""
        check_transition(JOB_TRANSITIONS, self.state, to, f"job {self.name}")
        self._note("transition", reason, state_from=self.state.value, state_to=to.value, **detail)
        self.state = to
        if to.terminal:
            self.ended_at = time.time()
        if not persist and not to.terminal:
            return
        number = self._persist()
        if to.terminal:
            self._ended(to, number)
