"""Background ("shadow") synchronization: the update rules and the thread that runs them. Pure torch.

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

Loss weighting: members of the `background` kind train on their own mean loss (the replica loop
does that for every kind in `base.LOCAL_MEAN`); a round here is the plain mean of the replicas.

Wired here: MA and BMUF over any communicator with `all_reduce(tensor) -> handle.wait(timeout)`
(actors/comm.py), EASGD over any object with `elastic(x, alpha) -> d` (`CentralCopy`; the in-process
`LocalCentral` serves tests). Not wired yet: the `shadow` Algorithm in the registry, its config in
core/schema.py, the second communicator per epoch in actors/replica.py, and the central copy on the
parameter server.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector

from algorithms.base import Algorithm, AlgorithmImpl, EpochInfo, VoteDraft, register
from algorithms.leases import Ticket
from algorithms.server import Fence
from core.schema import ShadowConfig

log = logging.getLogger(__name__)

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


class CentralCopy(Protocol):
    """The EASGD central copy (on the parameter server): one atomic elastic exchange per call."""

    def elastic(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """Apply c <- c + alpha (x - c) and return d = alpha (x - c) (computed from the old c)."""


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

    def __exit__(self, *exc: Any) -> None:
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
        self._comm: Any = None
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
    def start(self, comm: Any, max_rounds: int | None = None) -> None:
        """Begin a membership epoch's rounds over `comm` (its own group; unused by easgd)."""
        with self._state_lock:
            if self._state == Lifecycle.STARTED:
                raise RuntimeError(f"{self.name}: already started; stop() or abandon() first")
            self._generation += 1
            self._state = Lifecycle.STARTED
            self._comm = comm
            self._stop = threading.Event()
            self.thread = threading.Thread(target=self._run, args=(self._generation, comm, self._stop, max_rounds),
                                           name=f"{self.name} g{self._generation}", daemon=True)
        self.thread.start()

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
    def _run(self, generation: int, comm: Any, stop: threading.Event, max_rounds: int | None) -> None:
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

    def _round(self, generation: int, comm: Any, index: int) -> bool:
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

    def _combine(self, comm: Any, snapshot: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The round's target (ma: avg; bmuf: avg, moved to x_g at write-back; easgd: x - d) and the
        bytes it sent."""
        if self.config.method == "easgd":
            assert self.central is not None  # easgd: __init__ required it
            pull = self.central.elastic(snapshot, self.config.alpha)
            return snapshot - pull, 2 * snapshot.numel() * snapshot.element_size()
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


# --------------------------------------------------------------------------- the policy
class DispenserClient(Protocol):
    """A member's way to the job's lease dispenser and central copy (actors/parameter_server.py)."""

    def lease_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple[Ticket, ...]]:
        """`count` tickets of `size` samples; (refusal, ()) when refused or unreachable ("wait")."""

    def applied(self, fence: Fence, keys: list[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> None:
        """These tickets (first lease ids) were applied (sent without waiting). `final`: this member's
        run ended, every ticket up to clock `upto` applied; returns once the dispenser has it.
        `finished`: it reached its stop (its replica goes into the final model)."""

    def elastic(self, fence: Fence, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """EASGD's exchange with the central copy; raises when refused or unreachable."""


GroupFactory = Callable[[EpochInfo], Any]
"""Forms this member's background group of a membership epoch (its own gloo group, `<group>/bg`);
returns None when a newer membership superseded it, raises when it could not form."""


class _RemoteCentral:
    """The central copy on the dispenser, as `BackgroundSync` sees it."""

    def __init__(self, impl: ShadowImpl) -> None:
        self.impl = impl

    def elastic(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        client = self.impl.client
        assert client is not None  # rounds run once the member is connected
        return client.elastic(self.impl._fence(), x, alpha)


class ShadowImpl(AlgorithmImpl):
    """One member of `shadow`: the foreground trains on leased samples and never joins a collective;
    the background thread runs the rounds over a group of its own per membership epoch.

    Entering an epoch happens in a helper thread, never in the foreground: form the epoch's background
    group, then agree on who is new. A member that never held a live state (a joiner) receives the
    whole state of the lowest-ranked member that did (model, optimizer, step, the policy's state);
    BMUF's global copy and block step go from that member to everyone, so that they stay equal. At the
    job's start every member is new and nothing moves (identical replicas from the seed). Only a new
    member's foreground waits for this; the others train on throughout."""

    # The background rounds' runner. It shadows AlgorithmImpl.sync (a periodic kind's round), which is
    # never called for this kind: sync_due stays False.
    sync: BackgroundSync  # type: ignore[assignment]  # an attribute over the base's method, see above

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.client: DispenserClient | None = None
        self.slot, self.incarnation = "", 0
        self.make_group: GroupFactory | None = None
        self.save_state: Callable[[], bytes] = lambda: b""
        self.load_state: Callable[[bytes], None] = lambda blob: None
        central = _RemoteCentral(self) if self.config.method == "easgd" else None  # reached once connected
        self.sync = BackgroundSync(list(model.parameters()), self.config, central=central, name="shadow")
        self.fresh = True
        """Never held a live state: a joiner (or every member at the job's start)."""
        self.ready = threading.Event()
        """Set once this member holds a live state; a new member's foreground waits for it."""
        self.closed = False
        self.block: list[Ticket] = []
        self.ticket: Ticket | None = None
        self._prefetch: tuple[threading.Thread, dict] | None = None
        self._applied: list[int] = []
        self._generation = 0
        self._group: Any = None
        self._held: Any | None = None
        self._reported_failures = 0
        self._broken: str | None = None
        """Why this epoch's background group is broken (None while it works): asked again to re-form
        every `_retry_s` until a new epoch comes, since the coordinator may drop a request."""
        self._asked_at = 0.0
        self._retry_s = 5.0
        self.on_failure: Callable[[str], None] = lambda error: None
        """Told of a failed background round (the owner asks the coordinator to re-form)."""
        self.on_state: Callable[[str, int], None] = lambda source, epoch: None
        self.entries = 0
        self._upto = -1
        """The clock of the newest ticket applied (tickets are used in order)."""
        self.loaded_from: int | None = None

    def connect(self, client: DispenserClient, slot: str, incarnation: int) -> None:
        self.client, self.slot, self.incarnation = client, slot, incarnation

    def attach(self, make_group: GroupFactory, save_state: Callable[[], bytes], load_state: Callable[[bytes], None],
               on_failure: Callable[[str], None], on_state: Callable[[str, int], None] = lambda source, epoch: None) -> None:
        """The replica's side: how to form a background group, how to take or load its whole state, and
        whom to tell of a failed round or of a state received (`on_state(source slot, membership epoch)`)."""
        self.make_group, self.save_state, self.load_state, self.on_failure = make_group, save_state, load_state, on_failure
        self.on_state = on_state

    def _fence(self) -> Fence:
        return Fence(self.epoch.membership_epoch if self.epoch else 0, self.slot, self.incarnation, 0)

    @property
    def bytes_sent(self) -> int:
        return self.sync.stats.bytes_sent

    # ------------------------------------------------------------------ membership epochs
    def on_membership(self, comm: Any, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        if self.make_group is None:
            raise RuntimeError("shadow: the replica did not attach a background group factory")
        self._generation += 1
        self._broken = None
        self._retry_s = float(getattr(comm, "timeout_s", None) or self._retry_s)  # the coordinator's re-form rate
        threading.Thread(target=self._enter, args=(self._generation, epoch), daemon=True,
                         name=f"shadow entry e{epoch.membership_epoch}").start()
        if not self.block and self._prefetch is None and self.client is not None:
            self._start_prefetch()  # the first block arrives while the group forms

    def _enter(self, generation: int, epoch: EpochInfo) -> None:
        try:
            assert self.make_group is not None  # on_membership checked it
            group = self.make_group(epoch)
        except Exception as err:  # noqa: BLE001 - no background sync this epoch; the foreground trains on
            log.warning("shadow: the background group of epoch %d did not form: %s", epoch.membership_epoch, err)
            self._group_broken(generation, f"the background group did not form: {err}")  # the coordinator re-forms it
            return
        if group is None:
            return
        if generation != self._generation:
            group.close()
            return
        self._group = group
        try:
            self._agree(group, epoch)
        except Exception as err:  # noqa: BLE001 - a peer died meanwhile: the next epoch tries again
            log.warning("shadow: entering epoch %d failed: %s", epoch.membership_epoch, err)
            group.abort(str(err))
            self._group_broken(generation, f"entering the background group failed: {err}")  # a joiner must not wait forever
            return
        if generation != self._generation:
            return
        self.ready.set()
        if epoch.world_size > 1:
            self.sync.start(group)

    def _agree(self, group: Any, epoch: EpochInfo) -> None:
        """Who is new; the new receive a live member's state; BMUF's global copy is made equal."""
        device = getattr(group, "device", torch.device("cpu"))  # NCCL: the GPU
        fresh = torch.zeros(group.world_size, dtype=torch.float64, device=device)
        fresh[group.rank] = 1.0 if self.fresh else 0.0
        group.all_reduce(fresh).wait(group.timeout_s)
        fresh = fresh.cpu()
        live = [r for r in range(group.world_size) if fresh[r] == 0]
        self.entries += 1
        if not live:  # every member is new: the job's start (identical replicas from the seed)
            if epoch.membership_epoch > 1:  # joiners only, everyone who held a state is gone or done
                log.warning("shadow: no member of epoch %d holds a live state; this joiner stops without training",
                            epoch.membership_epoch)
                self.closed = True
            self.fresh = False
            return
        src = live[0]
        if fresh.any():
            size = torch.zeros(1, dtype=torch.int64, device=device)
            blob = None
            if group.rank == src:
                with self.sync.lock:
                    blob = torch.frombuffer(bytearray(self.save_state()), dtype=torch.uint8).to(device)
                size[0] = blob.numel()
            group.broadcast(size, src).wait(group.timeout_s)
            if blob is None:
                blob = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
            group.broadcast(blob, src).wait(group.timeout_s)
            if self.fresh:
                with self.sync.lock:
                    self.load_state(blob.cpu().numpy().tobytes())
                self.loaded_from = src
                self.on_state(epoch.members[src], epoch.membership_epoch)
        if self.sync.global_copy is not None:
            assert self.sync.block_step is not None  # set together with global_copy
            with self.sync.lock:
                both = torch.cat([self.sync.global_copy, self.sync.block_step])
            group.broadcast(both, src).wait(group.timeout_s)
            with self.sync.lock:
                n = self.sync.global_copy.numel()
                self.sync.global_copy, self.sync.block_step = both[:n].clone(), both[n:].clone()
        self.fresh = False

    def on_epoch_end(self, reason: str) -> None:
        self._generation += 1
        self._broken = None
        group, self._group = self._group, None
        if self.sync.state == Lifecycle.STARTED:
            self.sync.abandon(reason)
        elif group is not None:
            group.abort(reason)
        if group is not None:
            thread = self.sync.thread
            threading.Thread(target=_close_when_free, args=(group, thread), daemon=True, name="shadow close").start()

    # ------------------------------------------------------------------ the foreground
    def step_samples(self, step: int) -> np.ndarray | None:
        """The next leased share; empty while this new member waits for its state, or while the
        dispenser cannot deal (the loop comes back)."""
        if self.client is None:
            raise RuntimeError("policy 'shadow' needs the job's lease dispenser; none was connected")
        if not self.closed:
            self._report_failures()  # a joiner whose entry failed waits here: it asks again too
        if not self.ready.wait(0.2) or self.closed:
            return np.empty(0, dtype=np.int64)
        if not self.block:
            self.block = self._take_prefetch() or self._fetch()
            if not self.block:
                time.sleep(0.05)
                return np.empty(0, dtype=np.int64)
        self.ticket = self.block.pop(0)
        if len(self.block) <= self.config.lease_block // 2 and self._prefetch is None:
            self._start_prefetch()
        return np.asarray([i for lease in self.ticket.leases for i in lease.ids], dtype=np.int64)

    def _share(self) -> int:
        assert self.epoch is not None  # shares are dealt inside a membership epoch
        n, world, rank = self.epoch.global_batch, self.epoch.world_size, self.epoch.rank
        return n // world + (1 if rank < n % world else 0)

    def _fetch(self) -> list[Ticket]:
        assert self.client is not None  # step_samples checked it
        return self._tickets(self.client.lease_block(self._fence(), self.config.lease_block, self._share()))

    def _tickets(self, answer: tuple) -> list[Ticket]:
        """A dispenser's answer to a block request: its tickets; a "finished" refusal closes this member."""
        refusal, tickets = answer
        if refusal == "finished":
            self.closed = True
        return list(tickets)

    def _start_prefetch(self) -> None:
        box: dict = {}
        fence, count, size = self._fence(), self.config.lease_block, self._share()

        def fetch() -> None:
            try:
                assert self.client is not None  # step_samples and on_membership check it first
                box["answer"] = self.client.lease_block(fence, count, size)
            except Exception as err:  # noqa: BLE001 - fetched again in the foreground
                box["error"] = err
        thread = threading.Thread(target=fetch, daemon=True, name="shadow prefetch")
        self._prefetch = (thread, box)
        thread.start()

    def _take_prefetch(self) -> list[Ticket]:
        if self._prefetch is None:
            return []
        thread, box = self._prefetch
        self._prefetch = None
        thread.join()
        return self._tickets(box.get("answer", (None, ())))

    def _report_failures(self) -> None:
        """A round that failed stopped this epoch's background sync: ask the coordinator to re-form,
        and ask again every `_retry_s` while no new epoch comes."""
        failed = self.sync.stats.rounds_failed
        if failed > self._reported_failures and self.sync.state == Lifecycle.STOPPED:
            self._reported_failures = failed
            self._group_broken(self._generation, self.sync.stats.last_error or "a background round failed")
        elif self._broken is not None and time.monotonic() - self._asked_at >= self._retry_s:
            self._asked_at = time.monotonic()
            self.on_failure(self._broken)

    def _group_broken(self, generation: int, error: str) -> None:
        if generation != self._generation:
            return  # an older epoch's group: the new epoch re-formed it already
        self._broken, self._asked_at = error, time.monotonic()
        self.on_failure(error)

    def begin_step(self, step: int, draft: VoteDraft) -> None:
        """The foreground holds the lock from the forward through the optimizer step: a round's
        snapshot and write-back fall between steps (an in-place change of a parameter during a step
        would break its backward)."""
        self._held = self.sync.foreground()
        self._held.__enter__()
        super().begin_step(step, draft)

    def apply_update(self, step: int, lr: float) -> None:
        try:
            super().apply_update(step, lr)
        finally:
            self._release()

    def discard(self, step: int) -> None:
        self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)

    def commit(self, step: int) -> None:
        """The step is applied to this replica: its ticket is applied (the dispenser hears it without
        the foreground waiting)."""
        if self.ticket is not None:
            self._applied.append(self.ticket.leases[0].id)
            self._upto = self.ticket.clock
            self.ticket = None
        if self._applied:
            assert self.client is not None  # its tickets came from the dispenser
            self.client.applied(self._fence(), self._applied, self.sync.stats.rounds_completed)
            self._applied = []

    def stop_requested(self) -> bool:
        return self.closed

    def eval_parameters(self) -> torch.Tensor | None:
        """What an evaluation of the job's model should look at: the replicas' average as of the newest
        round (MA; BMUF's global copy), or None (EASGD, or no round yet: the live replica)."""
        return self.sync.average

    def record_fields(self) -> dict:
        stats = self.sync.stats
        return {"rounds": stats.rounds_completed, "rounds_failed": stats.rounds_failed,
                "blocked_s": round(stats.foreground_blocked_s, 6)}

    def close(self, finished: bool) -> None:
        """The run ended: the background thread stops (abandoned if stuck). A member that finished
        tells the dispenser so and waits until it has every notice (its replica goes into the final
        model: nothing of it died); one that left or failed is counted at its departure."""
        self._release()
        self.sync.request_stop()
        if self.client is not None and self.epoch is not None:  # before the group goes (its end may re-form the others)
            self.ticket = None  # dealt but not applied: it goes back with the holder's other tickets
            try:
                self.client.applied(self._fence(), self._applied, self.sync.stats.rounds_completed, final=True,
                                    upto=self._upto, finished=finished)
            except Exception as err:  # noqa: BLE001 - the dispenser may be gone at the end of the job
                log.warning("shadow: the last applied notices may be lost: %s", err)
            self._applied = []
        self.on_epoch_end("the member finished" if finished else "the member left")

    def state_dict(self) -> dict:
        return self.sync.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sync.load_state_dict(state)


def _close_when_free(group: Any, thread: threading.Thread | None) -> None:
    """Close an abandoned epoch's group once its thread is out of the collective (its timeout frees it)."""
    if thread is not None:
        thread.join(getattr(group, "timeout_s", 30.0) + 5.0)
        if thread.is_alive():
            return  # still stuck: leave the group to the garbage collector
    try:
        group.close()
    except Exception:  # noqa: BLE001
        pass


@register
class Shadow(Algorithm):
    name = "shadow"
    kind = "background"
    impl = ShadowImpl
