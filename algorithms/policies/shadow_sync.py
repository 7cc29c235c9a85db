"""Background ("shadow") synchronization's engine: the update rules and the thread that runs them. Pure torch.

The foreground (the training thread) never waits for synchronization. A background thread on each
member runs *rounds*, back to back or one every `interval_s`, over a communicator of its own that
belongs to one membership epoch (its operations never interleave with the foreground's, which use
another group). A round:

1. takes a snapshot s of the flattened parameters under the model lock;
2. combines it with the other members outside the lock (an all-reduce, or an exchange with the
   central copy), while the foreground keeps training;
3. only if that succeeded, writes back under the lock: x <- x + (target - s), so that the steps the
   foreground took during the round are kept (with the foreground held, x = target).

The rules (the standard forms of ShadowSync's MA, EASGD and BMUF), on flat tensors, as pure functions:

- MA: target = avg = (1/n) sum_i s_i.
- BMUF (block momentum eta, block learning rate zeta, global copy x_g and block step D, the same on
  every member): G = avg - x_g; D <- eta D + zeta G; x_g <- x_g + D; target = x_g. With eta = 0 and
  zeta = 1, x_g = avg: MA.
- EASGD (elastic weight alpha, central copy c on the parameter server): with d = alpha (x - c),
  x <- x - d and c <- c + d (both from the same x and c). A member's round sends its snapshot to the
  central copy, which applies its half atomically and returns d; the member applies x <- x - d.

The foreground holds the lock (`foreground()`) only during forward, backward and the optimizer step;
the lock is handed over in arrival order (a ticket lock: threading.Lock makes no promise that a
waiter gets it before the releasing thread re-acquires), so a round waiting for its snapshot or
write-back is not starved by the foreground's next step, and the foreground waits at most one
step's worth of copying, never a collective.

Lifecycle (BAGUA's `_AsyncInternalState`, made explicit): NEW -> STARTED (`start(comm)`, one per
membership epoch) -> STOPPED (`stop()`, a failed round, or `max_rounds` done) or ABANDONED
(`abandon(reason)`: the epoch ended; the communicator is aborted and the thread is left to die on
its own, never joined, since it may be stuck in a collective until the backend's timeout). Each
`start` opens a new generation; a thread of an older generation never writes back. A failed round
ends the thread (its group is broken); the owner re-forms the group and calls `start` again.

It runs MA and BMUF over any group with a sum all-reduce (`RoundGroup`, algorithms/policies/shadow_clients.py)
and EASGD over any `CentralCopy` (the in-process `LocalCentral` serves tests; the policy's goes to the
parameter server). The policy that drives it on each member is `ShadowImpl` (algorithms/policies/shadow.py).
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.utils import parameters_to_vector

from algorithms.policies.shadow_clients import CentralCopy, RoundGroup
from core.schema import ShadowConfig

Method = Literal["ma", "easgd", "bmuf"]


# --------------------------------------------------------------------------- rules
def ma_target(total: torch.Tensor, world_size: int) -> torch.Tensor:
    """Shadow-MA: the replicas' average, avg = (1/n) sum_i x_i, from the SUM-reduced snapshots."""
    return total / world_size


def bmuf_update(avg: torch.Tensor, global_copy: torch.Tensor, block_step: torch.Tensor,
                block_momentum: float, block_lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shadow-BMUF: G = avg - x_g; D <- eta D + zeta G; x_g <- x_g + D. Returns (new x_g, new D)."""
    step = block_momentum * block_step + block_lr * (avg - global_copy)
    return global_copy + step, step


def easgd_update(x: torch.Tensor, central: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shadow-EASGD: x <- x - alpha (x - c); c <- c + alpha (x - c), both from the old x and c.
    Returns (new x, new c)."""
    pull = alpha * (x - central)
    return x - pull, central + pull



class LocalCentral:
    """An in-process central copy (tests; the server's will keep the same contract)."""

    def __init__(self, initial: torch.Tensor) -> None:
        self.value = initial.detach().clone()
        self._lock = threading.Lock()

    def elastic(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        with self._lock:
            moved_x, self.value = easgd_update(x, self.value, alpha)
            return x - moved_x


# --------------------------------------------------------------------------- the thread
class Lifecycle(str, enum.Enum):
    NEW = "new"
    STARTED = "started"
    STOPPED = "stopped"
    ABANDONED = "abandoned"


@dataclass
class SyncStats:
    """Counters since construction (across epochs)."""

    rounds_completed: int = 0
    rounds_failed: int = 0
    bytes_sent: int = 0
    foreground_blocked_s: float = 0.0
    """Time the foreground spent waiting for the lock (a snapshot or a write-back in progress)."""
    round_s: float = 0.0
    """Wall time of the completed rounds."""
    last_error: str = ""


class _TicketLock:
    """A lock handed over in arrival order (threading.Lock lets a releasing thread re-acquire first)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            while self._serving != ticket:
                self._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


RoundHook = Callable[[str, int], None]
"""Test hook, called by the background thread as `hook(phase, round_index)` with phase `snapshot`
(after the snapshot, lock released) or `reduced` (the combine succeeded, before the write-back)."""


class BackgroundSync:
    """Runs shadow rounds on a daemon thread over a communicator given per membership epoch."""

    def __init__(self, params: Sequence[torch.nn.Parameter], config: ShadowConfig,
                 central: CentralCopy | None = None, timeout_s: float | None = None,
                 hook: RoundHook | None = None, name: str = "shadow") -> None:
        if config.method == "easgd" and central is None:
            raise ValueError("shadow easgd needs a central copy (the parameter server's)")
        self.params = [p for p in params if p.requires_grad]
        self.config = config
        self.central = central
        self.timeout_s = timeout_s
        """Seconds a round waits for its collective (None: the communicator's own timeout)."""
        self.hook = hook
        self.name = name
        self.stats = SyncStats()
        self.lock = _TicketLock()
        self._state_lock = threading.Lock()
        self._state = Lifecycle.NEW
        self._generation = 0
        self._comm: RoundGroup | None = None
        self._stop = threading.Event()
        self._released = threading.Event()
        self._released.set()
        self.thread: threading.Thread | None = None
        with torch.no_grad():
            self.global_copy = self._flat().clone() if config.method == "bmuf" else None
            """BMUF's x_g: equal on every member (the replicas start equal; a joiner loads it)."""
            self.block_step = torch.zeros_like(self.global_copy) if self.global_copy is not None else None  # bmuf
        self.average: torch.Tensor | None = None
        """MA: the replicas' average that the newest successful round computed; BMUF: x_g after it."""

    @property
    def state(self) -> Lifecycle:
        return self._state

    # ------------------------------------------------------------------ foreground side
    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Held by the training thread around forward, backward and the optimizer step."""
        started = time.perf_counter()
        self._released.wait()
        with self.lock:
            self.stats.foreground_blocked_s += time.perf_counter() - started
            yield

    @contextmanager
    def hold_foreground(self) -> Iterator[None]:
        """Test hook: `foreground()` does not begin while this is held (steps in progress finish)."""
        self._released.clear()
        try:
            yield
        finally:
            self._released.set()

    # ------------------------------------------------------------------ lifecycle
    def start(self, comm: RoundGroup | None, max_rounds: int | None = None) -> None:
        """Begin a membership epoch's rounds over `comm` (its own group; unused by easgd)."""
        with self._state_lock:
            if self._state == Lifecycle.STARTED:
                raise RuntimeError(f"{self.name}: already started; stop() or abandon() first")
            self._generation += 1
            self._state = Lifecycle.STARTED
            self._comm = comm
            self._stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(self._generation, comm, self._stop, max_rounds),
                                      name=f"{self.name} g{self._generation}", daemon=True)
            thread.start()  # started before it is published: an epoch's end that joins it never finds it unstarted
            self.thread = thread

    def request_stop(self) -> None:
        """Ask the thread to end after the round in progress (returns at once)."""
        self._stop.set()

    def stop(self, timeout: float = 1.0) -> Lifecycle:
        """End the thread after the round in progress, waiting at most `timeout` s for it; past that
        (its peers stopped first, or the collective is stuck) it is abandoned. Members that stop
        together should `request_stop()` first, so that none starts a round the others will not join."""
        self.request_stop()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return self.abandon("stop: the round in progress did not end in time")
        with self._state_lock:
            if self._state == Lifecycle.STARTED:
                self._state = Lifecycle.STOPPED
        return self._state

    def abandon(self, reason: str) -> Lifecycle:
        """The epoch is over: abort its communicator and leave the thread (never joined); it will
        not write back. Waits at most for a write-back in progress, never for a collective."""
        self._stop.set()
        with self._state_lock:
            self._generation += 1
            self._state = Lifecycle.ABANDONED
            comm, self._comm = self._comm, None
        if comm is not None and hasattr(comm, "abort"):
            comm.abort(reason)
        return self._state

    # ------------------------------------------------------------------ rounds
    def _run(self, generation: int, comm: RoundGroup | None, stop: threading.Event, max_rounds: int | None) -> None:
        done = 0
        while not stop.is_set() and (max_rounds is None or done < max_rounds):
            began = time.monotonic()
            if not self._round(generation, comm, done):
                break
            done += 1
            if self.config.interval_s > 0:
                stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - began)))
        with self._state_lock:
            if generation == self._generation and self._state == Lifecycle.STARTED:
                self._state = Lifecycle.STOPPED

    def _round(self, generation: int, comm: RoundGroup | None, index: int) -> bool:
        """One round; False when it failed (nothing was written back) or the epoch was left."""
        began = time.perf_counter()
        with self.lock:
            snapshot = self._flat().clone()
        self._call_hook("snapshot", index)
        try:
            target, sent = self._combine(comm, snapshot)
        except Exception as err:  # noqa: BLE001 - any failure of the collective is a failed round
            self._fail(f"{type(err).__name__}: {err}")
            return False
        self._call_hook("reduced", index)
        with self.lock, self._state_lock:
            if generation != self._generation:  # abandoned meanwhile: the result is not ours to apply
                self.stats.rounds_failed += 1
                self.stats.last_error = "abandoned during the round"
                return False
            self._write_back(target, snapshot)
            if self.config.method != "easgd":  # the replicas' average as of this round (BMUF: x_g)
                self.average = self.global_copy if self.global_copy is not None else target
            self.stats.rounds_completed += 1
            self.stats.bytes_sent += sent
            self.stats.round_s += time.perf_counter() - began
        return True

    def _combine(self, comm: RoundGroup | None, snapshot: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The round's target (ma: avg; bmuf: avg, moved to x_g at write-back; easgd: x - d) and the
        bytes it sent."""
        if self.config.method == "easgd":
            assert self.central is not None  # easgd: __init__ required it
            pull = self.central.elastic(snapshot, self.config.alpha)
            return snapshot - pull, 2 * snapshot.numel() * snapshot.element_size()
        if comm is None:
            raise RuntimeError(f"shadow {self.config.method}: a round needs its membership epoch's group")
        total = snapshot.clone()
        before = comm.bytes_sent
        comm.all_reduce(total).wait(self.timeout_s)
        return ma_target(total, comm.world_size), comm.bytes_sent - before

    def _write_back(self, target: torch.Tensor, snapshot: torch.Tensor) -> None:
        """x <- x + (target - snapshot), under the lock (BMUF first turns avg into the new x_g)."""
        if self.config.method == "bmuf":
            assert self.global_copy is not None and self.block_step is not None  # bmuf's, set in __init__
            self.global_copy, self.block_step = bmuf_update(target, self.global_copy, self.block_step,
                                                            self.config.block_momentum, self.config.block_lr)
            target = self.global_copy
        delta = target - snapshot
        with torch.no_grad():
            for p, d in zip(self.params, torch.split(delta, [p.numel() for p in self.params])):
                p.add_(d.view_as(p).to(p.dtype))

    def _fail(self, error: str) -> None:
        with self._state_lock:
            self.stats.rounds_failed += 1
            self.stats.last_error = error

    def _call_hook(self, phase: str, index: int) -> None:
        if self.hook is not None:
            self.hook(phase, index)

    def _flat(self) -> torch.Tensor:
        return parameters_to_vector(p.detach() for p in self.params)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """What a joiner needs besides the model: BMUF's x_g and block step (equal on every member)."""
        if self.global_copy is None:
            return {}
        assert self.block_step is not None  # set together with global_copy
        with self.lock:
            return {"global_copy": self.global_copy.clone(), "block_step": self.block_step.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state and self.global_copy is not None:
            with self.lock:
                self.global_copy = state["global_copy"].clone()
                self.block_step = state["block_step"].clone()
