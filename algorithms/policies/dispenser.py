"""The lease dispenser of the background kind (`shadow`), and its EASGD central copy. Pure: no Ray.

Members of a background policy train on their own, each at its own pace, so nobody deals a global
batch per step. They take their samples from the lease service (algorithms/rules/leases.py) in *blocks*
of several steps' tickets (one call per block, never one per step), and say which tickets they
applied. The dispenser runs on the job's parameter-server actor (actors/server/parameter_server.py), where
it survives a coordinator crash, and is fenced like the server: a call from a slot that is not a
member, or from a replaced incarnation of one, is refused.

Accounting (every leased sample ends exactly once: leased = applied + requeued + lost + outstanding):
- a ticket a member applied to its replica is `applied`: its samples are not dealt again within
  their data epoch (at most once);
- a departed member's tickets it never applied are `requeued`, with their data epoch, except the
  first `UNCERTAIN_AT_DEATH` of them when it died: it may have applied those (members use their
  tickets in order and tell each one without waiting, but send a notice only once the one before it
  was acknowledged: `NOTICES_IN_FLIGHT`; so at a death one notice may be in flight and the ticket
  after it applied, its notice waiting), so those are `lost`: counted, never dealt again within
  their data epoch;
- the samples a departed member applied after its last completed background round are counted as
  `died_with_replica` (a part of `applied`): their updates lived only in the lost replica. It is an
  upper bound: a round may have carried some of them before the member died, unheard here.
- at the end of the job, tickets still held are requeued (counted);
- a member's final notice ends its incarnation's run: a block it asked for before (a background
  prefetch) that arrives after the notice is refused, not dealt to a member that will never use it.

The central copy (EASGD): c starts as the initial parameters; `elastic(x, alpha)` applies
c <- c + alpha (x - c) and returns d = alpha (x - c), atomically (the caller holds the host's lock).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from algorithms.policies.server_messages import Fence
from algorithms.rules.leases import LeaseService, Ticket

BLOCK_REFUSALS = ("not_member", "fenced_worker", "finished")
NOTICES_IN_FLIGHT = 1
"""A member sends an applied notice only once at most this many earlier ones are unacknowledged."""
UNCERTAIN_AT_DEATH = NOTICES_IN_FLIGHT + 1
"""The open tickets a dead member may have applied unheard: those in flight, and the one applied after
them whose notice waits for an acknowledgement."""


class DispenserCore:
    def __init__(self, parameters: Sequence[torch.Tensor], n_samples: int, seed: int, global_batch: int) -> None:
        self.leases = LeaseService(n_samples, seed, global_batch)
        self.central = torch.nn.utils.parameters_to_vector([p.detach() for p in parameters]).clone()
        self.members: dict[str, int] = {}
        self.membership_epoch = 0
        self.incarnation = 0
        self.ended = False
        self.version = 0
        """Unused (no server version): kept for the host's snapshot names and summary."""
        self.blocks = 0
        self.elastic_rounds = 0
        self.died_with_replica = 0
        self.rejected: dict[str, int] = {}
        self._next_clock: dict[str, int] = {}
        self._rounds: dict[str, int] = {}
        """Per slot: the background rounds it had completed at its newest applied notice."""
        self._ended: set[tuple[str, int]] = set()
        """(slot, incarnation) whose run ended with a final notice: released then, not at its departure."""
        self._since_round: dict[str, int] = {}
        """Per slot: samples it applied since the newest round count it reported (the upper bound)."""

    @property
    def finished(self) -> bool:
        return self.ended

    def refusal(self, fence: Fence) -> str | None:
        if self.ended:
            return "finished"
        if fence.slot not in self.members:
            return "not_member"
        if fence.worker_incarnation != self.members[fence.slot]:
            return "fenced_worker"
        if (fence.slot, fence.worker_incarnation) in self._ended:
            return "finished"  # its run ended: a block it asked for before its final notice is not dealt
        return None

    def _refused(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1

    # ---------------------------------------------------------------- membership
    def set_members(self, epoch: int, members: Sequence[tuple[str, int]]) -> tuple:
        """A membership epoch (slot, worker incarnation). A departed or replaced slot's unapplied tickets
        go back to the queue; what it applied since its last round is counted as died with it."""
        new = dict(members)
        for slot, incarnation in self.members.items():
            if new.get(slot) != incarnation and (slot, incarnation) not in self._ended:
                self._release(slot, died=True, uncertain=True)
        self.members, self.membership_epoch = new, epoch
        return ()

    def _release(self, slot: str, died: bool, uncertain: bool = False) -> None:
        """`died`: its updates since its last round died with it; `uncertain`: no final notice said which
        tickets it applied."""
        held = sorted(self.leases.held(slot), key=lambda t: t.clock)
        for i, ticket in enumerate(held):  # a dead member's first open tickets may be applied, their notices lost
            self.leases.close(ticket, "lost" if uncertain and i < UNCERTAIN_AT_DEATH else "requeued")
        since = self._since_round.pop(slot, 0)
        if died:
            self.died_with_replica += since
        self._rounds.pop(slot, None)

    # ---------------------------------------------------------------- blocks
    def deal_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple[Ticket, ...]]:
        """`count` tickets of `size` samples each for `fence.slot` (requeued samples first)."""
        refusal = self.refusal(fence)
        if refusal:
            self._refused(refusal)
            return refusal, ()
        if count < 1 or size < 1:
            raise ValueError(f"a block needs count >= 1 and size >= 1, got {count} and {size}")
        clock = self._next_clock.get(fence.slot, 0)
        tickets = self.leases.deal_block(fence.slot, clock, count, size)
        self._next_clock[fence.slot] = clock + count
        self.blocks += 1
        return None, tuple(tickets)

    def applied(self, fence: Fence, keys: Sequence[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> int:
        """The sender applied the tickets named by their first lease ids, having completed `rounds`
        background rounds so far. Returns how many were still open (a repeated notice counts 0).
        `final`: the sender's run ended and it applied every ticket it holds up to clock `upto` (it
        uses them in order; their notices may still be on the way: the host runs calls concurrently,
        so they may arrive after this one): those are applied, the rest go back to the queue.
        `finished`: it reached its stop and goes into the final model, so nothing of it died (one that
        left did not: what it applied since its last round is counted as died with it)."""
        if fence.slot not in self.members or fence.worker_incarnation != self.members[fence.slot]:
            self._refused("not_member" if fence.slot not in self.members else "fenced_worker")
            return 0
        closed = self._close_applied(fence, keys, rounds)
        if final:
            closed += self._close_applied(fence, [t.leases[0].id for t in self.leases.held(fence.slot) if t.clock <= upto],
                                          rounds)
            self._release(fence.slot, died=not finished)
            self._ended.add((fence.slot, fence.worker_incarnation))
        return closed

    def _close_applied(self, fence: Fence, keys: Sequence[int], rounds: int) -> int:
        closed = 0
        if rounds > self._rounds.get(fence.slot, -1):
            self._rounds[fence.slot] = rounds
            self._since_round[fence.slot] = 0
        for key in keys:
            ticket = self.leases.open.get(key)
            if ticket is None or ticket.holder != fence.slot:
                continue
            self.leases.close(ticket, "applied")
            self._since_round[fence.slot] = self._since_round.get(fence.slot, 0) + ticket.samples
            closed += 1
        return closed

    # ---------------------------------------------------------------- central copy
    def elastic(self, fence: Fence, x: torch.Tensor, alpha: float) -> tuple[str | None, torch.Tensor | None]:
        """EASGD: d = alpha (x - c); c <- c + d; returns d (None with the refusal)."""
        refusal = self.refusal(fence)
        if refusal:
            self._refused(refusal)
            return refusal, None
        if x.numel() != self.central.numel():
            raise ValueError(f"elastic: {x.numel()} parameters sent, the central copy has {self.central.numel()}")
        d = alpha * (x.to(self.central.dtype) - self.central)
        self.central += d
        self.elastic_rounds += 1
        return None, d

    # ---------------------------------------------------------------- end
    def end(self) -> None:
        """The job is over: tickets still held are requeued (counted); later calls answer finished."""
        if self.ended:
            return
        self.ended = True
        for slot in list(self.members):
            for ticket in self.leases.held(slot):
                self.leases.close(ticket, "requeued")

    def summary(self) -> dict:
        return {"membership_epoch": self.membership_epoch, "blocks": self.blocks, "elastic_rounds": self.elastic_rounds,
                "rejected": dict(self.rejected),
                "leases": dict(self.leases.counts, outstanding=self.leases.outstanding,
                               died_with_replica=self.died_with_replica)}
