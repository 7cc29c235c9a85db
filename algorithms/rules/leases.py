"""The lease service: who trains on which samples, and what became of them. Pure numpy, no Ray.

A *lease* is (lease id, data epoch, sample ids). Members of a non-lockstep policy do not cut their
own share of a global batch: the one who applies updates (a server, or a dispenser) deals leases,
and every lease ends exactly once as

- `applied`: its gradient went into an update;
- `dropped`: its gradient arrived and was discarded (a quorum's late push, a push after the end);
- `requeued`: it ended without a gradient (its holder left or was replaced, it skipped ahead);
- `lost`: its holder died and may have applied it just before (a background member's notice in
  flight): its samples are not dealt again within their data epoch (at most once), and are counted.

So `leased = applied + dropped + requeued + lost + outstanding`, in samples. The samples of a lease that was
not applied go back to the front of the queue with their data epoch (dropped ones too: their
gradient was never used), and are dealt again, under new lease ids, before any fresh sample: so within
a data epoch every sample is applied once. A push is recognised by its lease ids: a lease that is no
longer open is never applied again (a retried or duplicated push).

Where samples come from: the same global permutation per (seed, data epoch) as the BSP sampler
(`algorithms/rules/sampler.py`), read from one global cursor. `deal(clock, holders)` takes the clock's
global batch of `global_batch` samples (requeued samples first, then fresh ones from the cursor) and
cuts it into the holders' shares exactly as BSP's `split_for_rank` does. With no requeue, clock c's
leases are therefore BSP's global batch c, rank by rank. A member's share is a *ticket*: one lease
per run of samples from one data epoch (normally one lease; two where a share straddles an epoch).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from algorithms.rules.sampler import GlobalSampler

Outcome = Literal["applied", "dropped", "requeued", "lost"]
OUTCOMES: tuple[Outcome, ...] = ("applied", "dropped", "requeued", "lost")


@dataclass(frozen=True)
class Lease:
    id: int
    data_epoch: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Ticket:
    """One holder's work for one clock: its share of the clock's batch, as leases."""

    holder: str
    clock: int
    rank: int
    """Its place in the clock's sum (updates add gradients in rank order)."""
    leases: tuple[Lease, ...]

    @property
    def samples(self) -> int:
        return sum(len(lease.ids) for lease in self.leases)

    @property
    def lease_ids(self) -> tuple[int, ...]:
        return tuple(lease.id for lease in self.leases)


def share_bounds(size: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's share of `size` positions, as `split_for_rank` cuts them."""
    base, extra = divmod(size, world)
    starts = [rank * base + min(rank, extra) for rank in range(world + 1)]
    return list(zip(starts[:-1], starts[1:]))


APPLIED_KEPT = 16384
"""Applied lease ids kept to tell a retried push (a duplicate) from a stale one: a retry comes within
seconds, and ids are dealt in order, so only the newest are kept (between this many and twice it);
every id below them is closed, and a push naming one is counted a duplicate."""


class LeaseService:
    """The lease table (open tickets), the requeue queue, the applied set and the outcome counts."""

    def __init__(self, n_samples: int, seed: int, global_batch: int) -> None:
        self.sampler = GlobalSampler(n_samples, seed)
        self.global_batch = global_batch
        self.cursor = 0
        """Global position of the next fresh sample (data epoch = cursor // n_samples)."""
        self.dealt = 0
        """Clocks dealt whole so far (`deal` goes in clock order)."""
        self.next_id = 0
        self.queue: list[tuple[int, list[int]]] = []
        """Requeued (data epoch, sample ids), served first, oldest first."""
        self.open: dict[int, Ticket] = {}
        """Open tickets by their first lease id."""
        self.applied: set[int] = set()
        """Ids of applied leases at or above `applied_floor`: a push naming one of them is a duplicate."""
        self.applied_floor = 0
        """Every lease id below this that is not open was closed (applied or not: no longer told apart)."""
        self.counts: dict[str, int] = dict.fromkeys(("leased",) + OUTCOMES, 0)

    # ---------------------------------------------------------------- dealing
    def deal(self, clock: int, holders: Sequence[str]) -> list[Ticket]:
        """Clock `clock`'s global batch, cut into the shares of `holders` (in rank order)."""
        if clock != self.dealt:
            raise ValueError(f"clock {clock} dealt out of order (next is {self.dealt})")
        if len(holders) > self.global_batch:
            raise ValueError(f"{len(holders)} holders cannot share a global batch of {self.global_batch}")
        epochs, ids = self._take(self.global_batch)
        self.dealt += 1
        return [self._issue(holder, clock, rank, epochs[a:b], ids[a:b])
                for rank, (holder, (a, b)) in enumerate(zip(holders, share_bounds(self.global_batch, len(holders))))]

    def deal_share(self, clock: int, holder: str, rank: int, world: int) -> Ticket:
        """One holder's share alone (ASP; a joiner or a re-pull for a clock already dealt): the size of
        rank `rank`'s share at world size `world`, from the queue."""
        start, end = share_bounds(self.global_batch, world)[rank]
        epochs, ids = self._take(end - start)
        return self._issue(holder, clock, rank, epochs, ids)

    def deal_block(self, holder: str, first_clock: int, count: int, size: int) -> list[Ticket]:
        """`count` tickets of `size` samples each for `holder`, at clocks `first_clock`, ... (the
        background kind's blocks: no global batch per clock), requeued samples first."""
        tickets = []
        for k in range(count):
            epochs, ids = self._take(size)
            tickets.append(self._issue(holder, first_clock + k, 0, epochs, ids))
        return tickets

    def _take(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The next `size` samples with their data epochs: requeued ones first, then fresh."""
        epochs, ids = [], []
        while size and self.queue:
            epoch, queued = self.queue[0]
            taken, rest = queued[:size], queued[size:]
            self.queue[0] = (epoch, rest)
            if not rest:
                self.queue.pop(0)
            epochs.append(np.full(len(taken), epoch))
            ids.append(np.asarray(taken, dtype=np.int64))
            size -= len(taken)
        if size:
            fresh = self.sampler.global_batch(self.cursor, size)
            positions = np.arange(self.cursor, self.cursor + size)
            epochs.append(positions // self.sampler.n)
            ids.append(fresh.astype(np.int64))
            self.cursor += size
        return np.concatenate(epochs), np.concatenate(ids)

    def _issue(self, holder: str, clock: int, rank: int, epochs: np.ndarray, ids: np.ndarray) -> Ticket:
        if len(ids) == 0:
            raise ValueError(f"an empty share for {holder} at clock {clock}")
        cuts = [0] + [i for i in range(1, len(epochs)) if epochs[i] != epochs[i - 1]] + [len(epochs)]
        leases = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            leases.append(Lease(self.next_id, int(epochs[a]), tuple(int(i) for i in ids[a:b])))
            self.next_id += 1
        ticket = Ticket(holder, clock, rank, tuple(leases))
        self.open[ticket.leases[0].id] = ticket
        self.counts["leased"] += ticket.samples
        return ticket

    # ---------------------------------------------------------------- outcomes
    def find(self, lease_ids: Sequence[int]) -> Ticket | None:
        """The open ticket with exactly these lease ids, or None (closed, or never dealt)."""
        ticket = self.open.get(lease_ids[0]) if lease_ids else None
        return ticket if ticket is not None and ticket.lease_ids == tuple(lease_ids) else None

    def was_applied(self, lease_ids: Sequence[int]) -> bool:
        if not lease_ids:
            return False
        key = lease_ids[0]
        return key in self.applied or (key < self.applied_floor and key not in self.open)

    def held(self, holder: str, clock: int | None = None) -> list[Ticket]:
        """Open tickets of `holder` (for one clock, or all)."""
        return [t for t in self.open.values() if t.holder == holder and (clock is None or t.clock == clock)]

    def close(self, ticket: Ticket, outcome: Outcome) -> None:
        """End `ticket`; what was not applied goes back to the queue with its data epoch."""
        del self.open[ticket.leases[0].id]
        self.counts[outcome] += ticket.samples
        for lease in ticket.leases:
            if outcome in ("applied", "lost"):
                self.applied.add(lease.id)
            else:
                self.queue.append((lease.data_epoch, list(lease.ids)))
        if len(self.applied) > 2 * APPLIED_KEPT:  # amortized: once every APPLIED_KEPT closes
            self.applied_floor = max(self.applied_floor, self.next_id - APPLIED_KEPT)
            self.applied = {i for i in self.applied if i >= self.applied_floor}

    @property
    def outstanding(self) -> int:
        return sum(t.samples for t in self.open.values())

    # ---------------------------------------------------------------- snapshots
    def state_dict(self) -> dict:
        """Plain ints, strings, lists and dicts (loads with `torch.load(weights_only=True)`)."""
        return {"cursor": self.cursor, "dealt": self.dealt, "next_id": self.next_id,
                "queue": [[epoch, list(ids)] for epoch, ids in self.queue],
                "open": [_ticket_state(t) for t in self.open.values()],
                "applied": sorted(self.applied), "applied_floor": self.applied_floor, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.dealt, self.next_id = state["cursor"], state["dealt"], state["next_id"]
        self.queue = [(epoch, list(ids)) for epoch, ids in state["queue"]]
        tickets = [_ticket_from(t) for t in state["open"]]
        self.open = {t.leases[0].id: t for t in tickets}
        self.applied = set(state["applied"])
        self.applied_floor = int(state.get("applied_floor", 0))
        self.counts = dict(state["counts"])


def _ticket_state(ticket: Ticket) -> dict:
    return {"holder": ticket.holder, "clock": ticket.clock, "rank": ticket.rank,
            "leases": [[lease.id, lease.data_epoch, list(lease.ids)] for lease in ticket.leases]}


def _ticket_from(state: dict) -> Ticket:
    leases = tuple(Lease(i, epoch, tuple(ids)) for i, epoch, ids in state["leases"])
    return Ticket(state["holder"], state["clock"], state["rank"], leases)
