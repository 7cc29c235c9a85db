"""Fault injection (`faults:` in the config), kept out of the step loop: for experiments and tests.

- `WorkerFaults` fires a worker's `kills` entries at their phase (`step`, `allreduce`, `checkpoint`,
  `join`, `user_exception`, `vote`), each once unless `repeat` (the coordinator records what
  fired, so the redo of a step after a reshape does not fire it again), and makes a straggler's
  steps take `slowdown` times as long by sleeping (a slow worker frees the CPU, as a slow GPU
  would).
- `FaultyComm` wraps a communicator so that an `allreduce` kill fires while the all-reduce (or a
  gossip exchange's first send) is in flight (like torchft's fault-injecting process-group wrapper).
- `CoordinatorFaults` kills the coordinator's own process at an exact point of the protocol.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from core.schema import FaultsConfig, KillFault

if TYPE_CHECKING:  # pragma: no cover
    from ray import ObjectRef

    from actors.transport.comm import BaseCommunicator

log = logging.getLogger(__name__)
# No torch at import (the coordinator imports `CoordinatorFaults`): the worker's side imports
# actors/transport/comm.py where it raises.


def jitter_factor(sigma: float, seed: int, slot: str, step: int) -> float:
    """exp(sigma * z), z standard normal from (seed, slot, step): median 1, the same on every run."""
    z = np.random.default_rng([seed, int(slot[1:]), step]).standard_normal()
    return float(np.exp(sigma * z))


class InjectedFault(RuntimeError):
    """Raised by `faults.kills` entries with `at: user_exception`."""


class WorkerFaults:
    def __init__(self, cfg: FaultsConfig, slot: str, record: Callable[[int, str, int, str], None],
                 kill_actor: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """`record(index, slot, step, phase)` tells the coordinator a kill fires (before it does);
        `kill_actor` asks Ray to kill this actor (`how: actor_kill`); `clock` and `sleep`: the time a
        straggler's step is measured and stretched by (a test's own clock makes it exact)."""
        self.clock, self.sleep = clock, sleep
        self.kills = cfg.kills
        self.slot = slot
        self.fired: set[int] = set()
        self._record = record
        self._kill_actor = kill_actor
        self.stragglers = [s for s in cfg.stragglers if s.slot == slot]

    def already_fired(self, fired: tuple[int, ...]) -> None:
        """The kill entries that fired in this slot's earlier workers (the coordinator counts them)."""
        self.fired = set(fired)

    def has(self, phase: str) -> bool:
        return any(k.slot == self.slot and k.at == phase for k in self.kills)

    def due(self, phase: str, step: int) -> KillFault | None:
        """The kill entry that fires now in this phase, recorded with the coordinator (fires once)."""
        for index, kill in enumerate(self.kills):
            at_step = kill.step <= step if phase == "join" else kill.step == step
            if kill.slot != self.slot or kill.at != phase or not at_step:
                continue
            if index in self.fired and not kill.repeat:
                continue
            self.fired.add(index)
            try:
                self._record(index, self.slot, step, phase)
            except Exception as err:  # noqa: BLE001 - the fault fires anyway
                log.warning("could not record fault #%d with the coordinator: %s", index, str(err).splitlines()[0][:200])
            return kill
        return None

    def maybe_fire(self, phase: str, step: int) -> None:
        kill = self.due(phase, step)
        if kill is not None:
            self.fire(kill, step)

    def lose_vote(self, step: int) -> None:
        """`at: vote`: this member loses the result of a vote the others commit (a split commit)."""
        if self.due("vote", step) is not None:
            from actors.transport.comm import CommError  # see the imports

            raise CommError(f"injected fault: {self.slot} lost the result of the commit vote for step {step + 1}")

    def straggle(self, started: float, step: int = 0) -> float:
        """A straggler's step takes `slowdown` times as long as it computed, plus `delay_s`, times the
        jitter factor of this (slot, step) when one is configured (of the entries in force at `step`,
        the number of committed steps: `from_step`). Returns the seconds slept (modelled
        compute: they count in the step-time estimate the coordinator watches)."""
        elapsed = self.clock() - started
        now = [s for s in self.stragglers if step >= s.from_step]  # the entries in force at this step
        if not now:
            return 0.0
        target = elapsed * max(s.slowdown for s in now) + max(s.delay_s for s in now)
        jitter = next((s.jitter for s in now if s.jitter is not None), None)
        if jitter is not None:
            target *= jitter_factor(jitter.sigma, jitter.seed, self.slot, step)
        if target - elapsed <= 0:
            return 0.0
        self.sleep(target - elapsed)
        return target - elapsed

    def fire(self, kill: KillFault, step: int) -> None:
        if kill.how == "raise":
            raise InjectedFault(f"injected user exception in slot {self.slot} at step {step}")
        if kill.how == "hang":
            while True:  # a step that never ends; control calls still answer
                time.sleep(1.0)
        sys.stdout.flush()
        if kill.how == "exit":
            os._exit(1)
        if kill.how == "actor_kill":
            self._kill_actor()
            time.sleep(10)
        os.kill(os.getpid(), signal.SIGKILL)

    def wrap(self, comm: BaseCommunicator, step: Callable[[], int]) -> Any:
        """The communicator, wrapped when an `allreduce` kill is configured for this slot."""
        return FaultyComm(comm, self, step) if self.has("allreduce") else comm


class FaultyComm:
    """Wraps a communicator so a `kills` entry with `at: allreduce` fires while one is in flight."""

    def __init__(self, inner: BaseCommunicator, faults: WorkerFaults, step: Callable[[], int]) -> None:
        self._inner = inner
        self._faults = faults
        self._step = step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def bytes_sent(self) -> int:
        return self._inner.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:  # the count is the wrapped group's (the job reads it there)
        self._inner.bytes_sent = value

    def all_reduce(self, tensor, op: str = "sum"):
        return self._in_flight(lambda: self._inner.all_reduce(tensor, op))

    def at_launch(self) -> None:
        """BSP on torch's reducer launches its buckets in C++ during backward: an `allreduce` kill
        fires as that backward begins, while the peers wait in their all-reduce."""
        self._in_flight(lambda: None)

    def all_to_all(self, output, tensor):
        """The first collective of a compressed scatter-gather: an `allreduce` kill lands in it."""
        return self._in_flight(lambda: self._inner.all_to_all(output, tensor))

    def send(self, tensor, dst: int):
        """A point-to-point send: an `allreduce` kill lands in the step's first one."""
        return self._in_flight(lambda: self._inner.send(tensor, dst))

    def exchange(self, sends, recvs):
        """A gossip exchange (its sends and receives as one operation): an `allreduce` kill lands in it."""
        return self._in_flight(lambda: self._inner.exchange(sends, recvs))

    def _in_flight(self, launch: Callable[[], Any]):
        kill = self._faults.due("allreduce", self._step())  # recorded first: the kill lands mid-operation
        handle = launch()
        if kill is not None:
            self._faults.fire(kill, self._step())
        return handle


class CoordinatorFaults:
    """`faults.coordinator`: the coordinator's process dies at `publish` (after plan `version` reached
    the workers, before it is saved), at `stop` (while it receives the first report after it saved
    a decision to stop) or at `recover` (a restarted incarnation, before it re-attached a worker).
    Each fires once; what fired is kept in the run directory."""

    def __init__(self, cfg: FaultsConfig, fired: set[str], save_fired: Callable[[set[str]], None],
                 event: Callable[[str], None]) -> None:
        self.entries = cfg.coordinator
        self.scales = cfg.scale
        self.fired = fired
        self._save = save_fired
        self._event = event
        self.die_on_report = False

    def stopping(self) -> None:
        """A stop is decided: a `stop` entry fires while the coordinator receives the next report."""
        self.die_on_report = True

    def due_scales(self, step: int) -> list[int]:
        """The counts of `faults.scale` entries whose step `step` has reached and that have not fired
        (each is marked fired and saved now, before the coordinator acts on it)."""
        due = []
        for index, scale in enumerate(self.scales):
            key = f"scale-{index}"
            if step >= scale.step and key not in self.fired:
                self.fired.add(key)
                due.append(scale.count)
                self._event(f"injected fault: scale to {scale.count} workers at step {scale.step} (step {step} committed)")
        if due:
            self._save(self.fired)
        return due

    def maybe_die(self, at: str, version: int = 0, delivered: Sequence[ObjectRef] = ()) -> None:
        for index, fault in enumerate(self.entries):
            key = f"coordinator-{index}"
            if fault.at != at or (at == "publish" and fault.version != version) or key in self.fired:
                continue
            self.fired.add(key)
            self._save(self.fired)
            self._event(f"injected fault: the coordinator dies at {at}" + (f" of plan {version}" if version else ""))
            if delivered:
                import ray

                ray.wait(list(delivered), num_returns=len(delivered), timeout=5)  # the plan reaches the workers first
            os.kill(os.getpid(), signal.SIGKILL)
