"""Injected faults (tests and experiments): stragglers, kills, coordinator and server deaths, scale requests,
delayed pushes and the modelled comm latency, each at a named slot and step."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from core.schema.errors import DAY_S, FieldError, within


@dataclass
class JitterSpec:
    """A random factor on each step's time: lognormal with median 1, drawn from (seed, slot, step)."""

    dist: Literal["lognormal"] = "lognormal"
    sigma: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dist != "lognormal":
            raise FieldError("dist", f"must be lognormal, got {self.dist!r}")
        if not 0 <= self.sigma <= 3:
            raise FieldError("sigma", f"must be in [0, 3], got {self.sigma}")


@dataclass
class StragglerFault:
    slot: str = ""
    slowdown: float = 1.0
    """Each step takes this many times as long (a sleep after compute)."""
    delay_s: float = 0.0
    """Each step also sleeps this long: a fixed compute time, so a run's pace is the same on fast
    and slow machines. In [0, 86400] s (a sleep of more than a day is a hang: `errors.DAY_S`)."""
    jitter: JitterSpec | None = None
    """The step's time (computed x slowdown + delay_s) is multiplied by a seeded random factor; a
    factor below 1 cannot shorten the computation itself, only the sleep."""
    from_step: int = 0
    """Slow only once this many steps are committed (a straggler that appears mid-run; numbered as
    `kills[].step`). Entries for one slot combine: the largest slowdown and delay_s of those in force."""

    def __post_init__(self) -> None:
        _check_slot(self.slot)
        if self.from_step < 0:
            raise FieldError("from_step", f"must not be negative, got {self.from_step}")
        if self.slowdown < 1.0:
            raise FieldError("slowdown", f"must be >= 1.0, got {self.slowdown}")
        within(self, "delay_s", 0.0, DAY_S, unit=" s")


@dataclass
class KillFault:
    slot: str = ""
    step: int = 0
    """The step it fires at; with `at: join`, the first join of that slot at or after this step."""
    at: Literal["allreduce", "checkpoint", "join", "user_exception", "step", "vote"] = "step"
    """`vote`: the member loses the result of that step's commit vote while the others commit it
    (a split commit, as when a peer fails mid-reduction); `how` does not apply."""
    how: Literal["sigkill", "exit", "actor_kill", "raise", "hang"] = "sigkill"
    """`hang`: the step never ends (the process still answers control calls)."""
    repeat: bool = False

    def __post_init__(self) -> None:
        _check_slot(self.slot)
        if self.step < 0:
            raise FieldError("step", f"must not be negative, got {self.step}")
        if self.at == "user_exception":
            self.how = "raise"


@dataclass
class CoordinatorFault:
    """Kill the coordinator's process at an exact point of the protocol (Ray restarts it)."""

    at: Literal["publish", "stop", "recover"] = "publish"
    """`publish`: right after plan `version` has reached the workers, before the coordinator has
    saved it; `stop`: after it has saved a decision to stop (state STOPPING), while it receives the
    next progress report (whose records are lost with it); `recover`: a restarted coordinator, as it
    begins to re-attach its workers (it dies again before it has seen any of them)."""
    version: int = 0

    def __post_init__(self) -> None:
        if self.at == "publish" and self.version < 1:
            raise FieldError("version", f"must name a plan version (1 or more) for at: publish, got {self.version}")


@dataclass
class ScaleFault:
    """A scale request at a named step: once the job has committed `step`, the coordinator scales it to
    `count` workers, as `scale` from a shell would (tests and experiments: the order of a scale and
    other faults is written in the config, not left to when a driver's call arrives)."""

    step: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if self.step < 1:
            raise FieldError("step", f"must be 1 or more (a committed step), got {self.step}")
        if self.count < 1:
            raise FieldError("count", f"must be 1 or more, got {self.count}")


@dataclass
class DelayedPush:
    """A server policy's push held in flight (a slow network): the parameter server takes the first
    push of `slot` for clock `clock` (that slot's `clock`-th push, from 0) `delay_s` seconds after it
    was sent. The worker waits for the answer meanwhile; past `workers.hang_timeout_s` it is evicted,
    so the push arrives from an incarnation that is no longer a member."""

    slot: str = ""
    clock: int = 0
    delay_s: float = 1.0
    """In (0, 86400] s (`errors.DAY_S`)."""

    def __post_init__(self) -> None:
        _check_slot(self.slot)
        if self.clock < 0:
            raise FieldError("clock", f"must not be negative, got {self.clock}")
        within(self, "delay_s", 0.0, DAY_S, low_open=True, unit=" s")


@dataclass
class ServerFault:
    """Server policies: the parameter server's process SIGKILLs itself once it has applied `version`,
    after the snapshot being stored (if one is) has been stored, so the restart's loss is named by the
    config, not by when a driver's kill arrived. Only the server's first incarnation fires it: the
    restarted server resumes from its newest snapshot and carries on past `version`."""

    version: int = 0

    def __post_init__(self) -> None:
        if self.version < 1:
            raise FieldError("version", f"must name a version (1 or more), got {self.version}")


@dataclass
class FaultsConfig:
    stragglers: list[StragglerFault] = field(default_factory=list)
    kills: list[KillFault] = field(default_factory=list)
    coordinator: list[CoordinatorFault] = field(default_factory=list)
    scale: list[ScaleFault] = field(default_factory=list)
    """Scale requests at named steps (see `ScaleFault`), each once."""
    delayed_pushes: list[DelayedPush] = field(default_factory=list)
    """Server policies only: pushes the parameter server takes late (see `DelayedPush`)."""
    server: list[ServerFault] = field(default_factory=list)
    """Server policies only: the parameter server's process dies at a named version (see `ServerFault`)."""
    comm_latency_s: float = 0.0
    """A modelled network latency: every collective of every group (the background kind's too)
    completes no sooner than this many seconds after its launch (benchmarks: a slow network on one
    machine). Overlapped operations overlap their latencies, as on a real network. In [0, 86400] s, as
    every injected wait here (`errors.DAY_S`)."""
    record_samples: bool = False
    """Each worker appends `step membership_epoch id id ...` for every step it commits to
    `samples/<slot>.txt` (tests); a step counts in the epoch that history gives for it."""
    checkpoint_store_s: float = 0.0
    """Storing each checkpoint takes at least this long (a slow upload), off the coordinator's event loop."""
    checkpoint_fail_s: float = 0.0
    """Every try to store a checkpoint fails for this long after the coordinator starts (a store that is
    down): each failure is a `checkpoint_failed` event, and the try is made again with backoff."""

    def __post_init__(self) -> None:
        for knob in ("comm_latency_s", "checkpoint_store_s", "checkpoint_fail_s"):
            within(self, knob, 0.0, DAY_S, unit=" s")


def _check_slot(slot: str) -> None:
    if not re.fullmatch(r"w\d+", slot or ""):
        raise FieldError("slot", f"must name a slot like 'w1', got {slot!r}")
