"""The coordinator's view of one worker, and the small Ray helpers it uses on workers."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.messages import ReadyAnswer
from actors.runs.storage import first_line
from algorithms.rules.supervision import MEMBER_TRANSITIONS, MemberState, check_transition

log = logging.getLogger(__name__)


@dataclass
class Member:
    slot: str
    handle: Any
    pid: int = 0
    node: str = ""
    node_id: str = ""
    store_port: int = 0
    """The port of the group store its process serves on `node` (a plan whose rank 0 it is names it)."""
    lifeline: dict | None = None
    """Where its process's lifeline is (actors/lifeline.py), as its ready answer said; None: it has none."""
    state: MemberState = MemberState.STARTING
    step: int = 0
    last_report: float = 0.0
    compute_s: float = 0.0
    cause: str = ""
    """Why the member is hung, retired or failed."""
    waiting_for: str = ""
    """While it starts, what it waits for that the user may need to know (a hot spare to be ready; room
    Ray has not got: then `unplaced` too); written by the launcher, shown in `status`."""
    unplaced: bool = False
    """Its actor could not be placed within `workers.pause_after_s`: the cluster lacks what it asks."""
    evicted: tuple[str, str] | None = None
    """(detector, cause) when the coordinator evicted it before its watch() ended: killed for hanging, or
    found dead by a probe."""
    actor_name: str = ""
    """The Ray actor's name when it is not the slot's own (a hot spare it adopted)."""
    holds_state: bool = True
    """False while a joiner admitted to a running job waits for the committed state, and once a member
    finished without ever training or loading one: not a replica of the final model, not the job's
    step, and no one to carry the job on alone (it would start over from its initial model)."""
    incarnation: int = 0
    """Which start of the slot this is (a parameter server fences the pushes of earlier ones)."""
    join_reason: tuple[str, str, float] = ("", "", 0.0)
    """(reason, detector, decided at) of the decision that started it."""
    watch_task: asyncio.Task | None = field(default=None, repr=False)
    beat_task: asyncio.Task | None = field(default=None, repr=False)

    def move(self, to: MemberState) -> None:
        """The one way a member's state changes: IllegalTransition where `MEMBER_TRANSITIONS` (algorithms/
        supervision.py) does not allow it (a member that ended never trains again)."""
        check_transition(MEMBER_TRANSITIONS, self.state, to, f"member {self.slot}")
        self.state = to

    # The coordinator's parts change a member only through these: each field has this one writer.
    def ends_before_training(self, state: MemberState, cause: str) -> None:
        """A start that failed or a slot retired, or a member a restarted coordinator found gone: it never
        trained under this incarnation, so no transition of a live member applies."""
        self.state, self.cause = state, cause

    def says(self, cause: str) -> None:
        """Why it is hung, retired, failed or dropped (`status` shows it)."""
        self.cause = cause

    def numbered(self, incarnation: int) -> None:
        self.incarnation = incarnation

    def runs_in(self, handle: Any, actor_name: str = "") -> None:
        """Its worker is this actor (`actor_name` where it is not the slot's own: a hot spare it adopted)."""
        self.handle, self.actor_name = handle, actor_name

    def waits(self, waiting_for: str = "", unplaced: bool = False) -> None:
        """What its start waits for that the user may need to know ("" once it does not)."""
        self.waiting_for, self.unplaced = waiting_for, unplaced

    def placed(self, answer: ReadyAnswer) -> None:
        """Its worker answered ready: where its process runs and serves its group store."""
        self.pid, self.node, self.node_id = answer.pid, answer.node, answer.node_id
        self.store_port, self.lifeline = answer.store_port, answer.lifeline
        self.waiting_for, self.unplaced = "", False

    def holds(self, state: bool) -> None:
        """Whether it holds a committed state of its own (a joiner once it loaded one)."""
        self.holds_state = state

    def reported(self, step: int, at: float, compute_s: float) -> None:
        self.step, self.last_report, self.compute_s = step, at, compute_s

    def evict(self, detector: str, cause: str) -> None:
        self.evicted = (detector, cause)

    def watched_by(self, task: asyncio.Task) -> None:
        self.watch_task = task

    def beaten_by(self, task: asyncio.Task) -> None:
        self.beat_task = task


@dataclass
class Spare:
    """A hot spare: a worker actor started (imports done, the workload built) outside the group."""

    name: str
    handle: Any = None
    """None until the actor is created (off the coordinator's event loop)."""
    pid: int = 0
    node: str = ""
    node_id: str = ""
    started_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    """When it was ready (its start took `ready_at - started_at`); None while it starts."""
    unplaced: str = ""
    """What the cluster lacks for it, once it could not be placed within `workers.pause_after_s`."""

    @property
    def ready(self) -> bool:
        return self.ready_at is not None

    def created(self, handle: Any) -> None:
        self.handle = handle

    def placed(self, answer: ReadyAnswer) -> None:
        """Its actor answered ready: where its process runs."""
        self.pid, self.node, self.node_id, self.ready_at = answer.pid, answer.node, answer.node_id, time.time()
        self.unplaced = ""

    def lacks(self, short: str) -> None:
        """The cluster lacks what it asks (`status` says so)."""
        self.unplaced = f"cannot be placed: it {short}"

    def status(self) -> dict:
        return {"name": self.name.rsplit("/", 1)[-1], "state": "ready" if self.ready else "starting", "pid": self.pid,
                "node": self.node, "started_at": self.started_at, "ready_at": self.ready_at, "cause": self.unplaced}


def kill(handle) -> None:
    if handle is None:
        return
    try:
        ray.kill(handle, no_restart=True)
    except Exception as err:  # noqa: BLE001 - already gone
        log.debug("ray.kill: %s", first_line(err))


def describe(err: BaseException) -> str:
    """The cause of an error raised inside an actor, not Ray's `ray::Worker.ready() (pid=...)` header."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {first_line(cause)}"
    text = str(err)
    if CREATION_FAILED in text:  # the actor's constructor raised: Ray keeps only the text of its traceback
        raised = _raised_line(text)
        if raised:
            return f"its constructor raised {raised}"
    return first_line(err)


CREATION_FAILED = "raised in its creation task"


def _raised_line(traceback_text: str) -> str:
    """`Type: message` (its first line) of the exception a traceback's text ends with: the first line at
    column 0 after the last frame ("  File ...", then the frame's indented source line)."""
    lines = traceback_text.splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return ""
    for line in lines[frames[-1] + 1:]:
        if line.strip() and not line.startswith(" "):
            return line.strip()[:500]
    return ""


def is_placed(handle) -> bool | None:
    """Whether Ray has given this actor a process (from the GCS actor table: no dashboard needed);
    None when that cannot be told."""
    if handle is None:
        return False
    try:
        from ray._private.state import state

        info = state.actor_table(handle._actor_id.hex())
        return bool(info and info.get("Pid"))
    except Exception as err:  # noqa: BLE001 - a private API: unknown rather than wrong
        log.debug("could not read the actor table: %s", err)
        return None


def job_is_dead(job_id: str) -> bool:
    """Whether the Ray job (a driver) has ended; unknown counts as alive."""
    try:
        from ray._private.state import jobs

        return any(j["JobID"] == job_id and j["IsDead"] for j in jobs())
    except Exception as err:  # noqa: BLE001 - unknown counts as alive
        log.debug("could not read Ray's job table: %s", err)
        return False


def log_to(path: Path, level: str) -> None:
    """This process's log records go to `path` (the run directory, made here when a restart on
    another node finds none), at `level`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
