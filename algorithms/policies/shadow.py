"""The `shadow` policy on one member: the foreground trains on leased samples, the background syncs.

`ShadowImpl` is the worker-side implementation of the background kind: its foreground takes tickets
of samples from the job's lease dispenser (in blocks, the next block fetched while the current one is
used) and never joins a collective; a `BackgroundSync` (algorithms/policies/shadow_sync.py: the rules, the
rounds and the thread that runs them) combines the replicas over a group of its own per membership
epoch. What it talks to (the background group, the dispenser, EASGD's central copy) it sees through
the Protocols of algorithms/policies/shadow_clients.py. The names those two modules define are importable
from here too.

Loss weighting: members of the `background` kind train on their own mean loss (the replica loop
does that for every kind whose `local_mean` is true); a round is the plain mean of the replicas.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms.policies.base import Algorithm, AlgorithmImpl, EpochInfo, VoteDraft, register
from algorithms.policies.server_messages import Fence
from algorithms.policies.shadow_clients import BackgroundGroup, DispenserClient, GroupFactory
from algorithms.policies.shadow_sync import BackgroundSync, Lifecycle
from algorithms.rules.kinds import BACKGROUND
from algorithms.rules.leases import Ticket

log = logging.getLogger(__name__)


@dataclass
class _Fetched:
    """What a prefetch of a block of tickets brought back (filled in by its helper thread)."""

    answer: tuple[str | None, tuple[Ticket, ...]] = (None, ())
    """The dispenser's answer; stays empty when the fetch failed (the foreground fetches again)."""
    error: Exception | None = None


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
        self._prefetch: tuple[threading.Thread, _Fetched] | None = None
        self._applied: list[int] = []
        self._generation = 0
        self._group: BackgroundGroup | None = None
        self._held: AbstractContextManager[None] | None = None
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

    def _agree(self, group: BackgroundGroup, epoch: EpochInfo) -> None:
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

    def _tickets(self, answer: tuple[str | None, tuple[Ticket, ...]]) -> list[Ticket]:
        """A dispenser's answer to a block request: its tickets; a "finished" refusal closes this member."""
        refusal, tickets = answer
        if refusal == "finished":
            self.closed = True
        return list(tickets)

    def _start_prefetch(self) -> None:
        box = _Fetched()
        fence, count, size = self._fence(), self.config.lease_block, self._share()

        def fetch() -> None:
            try:
                assert self.client is not None  # step_samples and on_membership check it first
                box.answer = self.client.lease_block(fence, count, size)
            except Exception as err:  # noqa: BLE001 - fetched again in the foreground
                box.error = err
        thread = threading.Thread(target=fetch, daemon=True, name="shadow prefetch")
        self._prefetch = (thread, box)
        thread.start()

    def _take_prefetch(self) -> list[Ticket]:
        if self._prefetch is None:
            return []
        thread, box = self._prefetch
        self._prefetch = None
        thread.join()
        return self._tickets(box.answer)

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


def _close_when_free(group: BackgroundGroup, thread: threading.Thread | None) -> None:
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
    kind = BACKGROUND
    impl = ShadowImpl
