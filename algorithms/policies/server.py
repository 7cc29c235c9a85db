"""The update rule of the server policies (asp, ssp, quorum, elastic_bsp): pure torch, no Ray, no threads.

`ServerCore` is what a parameter-server actor holds: the parameters as flat float32 buffers (one per
shard), an optimizer per shard built from the job's optimizer config, the version (applied updates),
the clock table, the staged pushes, the lease service (algorithms/rules/leases.py) and counters. The actor
only moves bytes and calls `set_members`, `pull` and `push`; every decision is made here.

The rules (members weight their loss by n_i / B, their share of the global batch B, as in BSP, so a
push carries the gradient of (1 / B) * the sum of its samples' losses):

- `asp`: each push is applied as it arrives, scaled by B / n_i: a lone push is one optimizer step on
  its own samples' mean gradient. Learning-rate convention: the configured LR (and schedule, over
  versions) is used per *push*, unchanged; with n members ASP makes about n updates per B samples,
  each on about B / n samples, so `max_steps` versions see about 1 / n of the samples that as many
  BSP steps see.
- `ssp` (`s`): clock c is applied once every live member has pushed it: one optimizer step on the sum
  of the clock's pushes, taken in rank order, scaled by B / sum(applied n_i) (so 1 when every share
  arrived). A member may pull clock c only once version >= c - s (`pull_ready`). `s: 0` is BSP.
- `quorum` (`k`): clock c is applied once k members have pushed it (the same sum and scaling); a
  push for a clock already applied is dropped and its samples requeued. `k` = n is BSP.
- `elastic_bsp` (`r`): pushes are applied as in ASP, except each member's barrier push: the round
  under way (`BarrierRound`) names, for every member in it, the clock whose push is its barrier push;
  that push is staged, and its puller waits, until every member of the round has sent its own; then
  they are applied as one update (the same sum and scaling) and the next round begins. A round begins
  with each member's barrier `r` iterations ahead (the fallback), which the coordinator's ZipLine
  schedule (`set_schedule`) replaces when it comes in time. A departure releases a barrier that waited
  only for the departed; a joiner waits for the next round. `r: 1` is a barrier at every push: BSP.

For ssp and quorum the version is the number of applied clocks, so clock c is applied as version
c + 1. The LR schedule and `max_steps` count versions. Staleness of an applied push = version at
apply - version it pulled (0 under BSP settings); `staleness` is its histogram.

Membership (`set_members`): clocks are kept per slot. A departed (or replaced) slot leaves the clock
table, its open tickets are requeued, and what it already pushed stays staged, so clocks complete
without it. A joiner starts at the minimum live clock (quorum: not below the next clock to apply); a
replacement in the same slot (a new worker incarnation) starts after the newest clock its slot has a
push staged for, since that slot's share of those clocks is already in. A ticket already pushed is
never handed out again.

Fencing: pulls and pushes carry a `Fence` (membership epoch, slot, worker incarnation, server
incarnation). A push from a slot that is not a member, from an incarnation the slot no longer has,
or addressed to an older server incarnation is refused and counted; so is a pull of the first two
kinds. The membership epoch is recorded, not compared: a live member's push from the previous epoch
is still good work, because server kinds never redo a step.

The parameters live in shards, each with its own optimizer (`ShardedParameters`,
algorithms/policies/server_shards.py); the messages are in algorithms/policies/server_messages.py and elastic_bsp's
barrier rounds in algorithms/policies/server_barriers.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch

from algorithms.policies.optim import lr_at
from algorithms.policies.server_barriers import BarrierRound
from algorithms.policies.server_messages import NOT_APPLIED, Fence, Pull, Push, PushResult, PushStatus, Update
from algorithms.policies.server_shards import ShardedParameters
from algorithms.rules.leases import LeaseService, Ticket
from core.schema import ASPConfig, ElasticBSPConfig, OptimizerConfig, QuorumConfig, SSPConfig

ServerPolicy = ASPConfig | SSPConfig | QuorumConfig | ElasticBSPConfig


class ServerCore:
    """A server policy's whole state and the rules that change it (see the module's docstring)."""

    def __init__(self, parameters: Sequence[torch.Tensor], optimizer: OptimizerConfig, policy: ServerPolicy, *,
                 n_samples: int, seed: int, global_batch: int, shards: int = 1, max_steps: int | None = None) -> None:
        if isinstance(policy, QuorumConfig) and policy.k is None:
            raise ValueError("quorum needs k (the schema fills in its default)")
        self.policy = policy
        self.optimizer_config = optimizer
        self.global_batch = global_batch
        self.max_steps = max_steps
        self.model = ShardedParameters(parameters, optimizer, shards)
        self.numel = self.model.numel
        self.leases = LeaseService(n_samples, seed, global_batch)
        self.version = 0
        self.incarnation = 0
        self.membership_epoch = 0
        self.members: dict[str, int] = {}
        """slot -> worker incarnation, in rank order."""
        self.clocks: dict[str, int] = {}
        """slot -> the clock it works on (the next it pushes); live members only."""
        self.staged: dict[int, list[dict]] = {}
        """clock -> pushes waiting for it to complete (ssp, quorum)."""
        self.round = BarrierRound()
        """elastic_bsp: the barrier under way."""
        self.ended = False
        """`end()` ran: the job is over (at `max_steps`, or stopped)."""
        self.schedules: dict[str, int] = {"zipline": 0, "fallback": 0, "late": 0}
        """elastic_bsp: how each round's barrier was placed (a late schedule is refused: a member had
        already passed the iteration it named)."""
        self.member_buffers: dict[str, torch.Tensor] = {}
        """Each member's newest buffers (from its pushes): the final model's come from them."""
        self.staleness: dict[int, int] = {}
        self.rejected: dict[str, int] = dict.fromkeys(NOT_APPLIED, 0)
        """Pushes that were not applied, by reason (fenced, duplicate, stale, dropped late, after the end)."""

    # ---------------------------------------------------------------- the rule's parameters
    @property
    def clocked(self) -> bool:
        """ssp and quorum apply whole clocks; asp and elastic_bsp apply single pushes (elastic_bsp's
        barriers aside)."""
        return not isinstance(self.policy, (ASPConfig, ElasticBSPConfig))

    @property
    def elastic(self) -> bool:
        return isinstance(self.policy, ElasticBSPConfig)

    @property
    def bound(self) -> int | None:
        """How far a pull may run ahead of the version, in clocks (None: no bound)."""
        if isinstance(self.policy, SSPConfig):
            return self.policy.s
        return 0 if isinstance(self.policy, QuorumConfig) else None

    @property
    def finished(self) -> bool:
        return self.max_steps is not None and self.version >= self.max_steps

    def pull_ready(self, clock: int) -> bool:
        """Whether a pull at `clock` may proceed: version >= clock - s (quorum: s = 0; asp: always)."""
        return self.bound is None or self.version >= clock - self.bound

    def parameters(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat parameter vector (a copy; into `out` when given)."""
        return self.model.parameters(out)

    # ---------------------------------------------------------------- membership
    def set_members(self, epoch: int, members: Sequence[tuple[str, int]]) -> tuple[Update, ...]:
        """A new membership epoch: (slot, worker incarnation) in rank order. Departed and replaced slots
        leave the clock table and their open tickets are requeued; joiners start at the minimum live
        clock. Returns the versions that departures completed."""
        new = dict(members)
        pushed: dict[str, int] = {}
        for slot, incarnation in self.members.items():
            if new.get(slot) != incarnation:
                self._requeue_unpushed(slot)
                del self.clocks[slot]
                self.round.at.pop(slot, None)  # the barrier no longer waits for it
                if slot in new:  # replaced in its own slot: the old incarnation's staged pushes stand
                    pushed[slot] = self._pushed_through(slot)
        start = self._start_clock()
        self.members, self.membership_epoch = new, epoch
        for slot in new:
            self.clocks.setdefault(slot, max(start, pushed.get(slot, -1) + 1))
        if self.elastic:
            return self._barrier_ready()
        return self._apply_ready()

    def _pushed_through(self, slot: str) -> int:
        """The newest clock for which `slot` has a push staged (-1: none). A replacement in the same
        slot starts after it: that slot's share of those clocks is in, and a ticket is pushed once."""
        clocks = [p["clock"] for pushes in self.staged.values() for p in pushes
                  if self.leases.open[p["lease"]].holder == slot]
        return max(clocks, default=-1)

    def buffers(self) -> list[torch.Tensor]:
        """The newest buffers of the live members in rank order (of every member heard from, when none
        of the live ones has pushed yet)."""
        live = [self.member_buffers[s] for s in self.members if s in self.member_buffers]
        return live or list(self.member_buffers.values())

    def _start_clock(self) -> int:
        if not self.clocked:
            return 0
        live = min(self.clocks.values(), default=self.version)
        return max(live, self.version)

    def _refusal(self, fence: Fence) -> Literal["not_member", "fenced_worker"] | None:
        """Why a pull or a push from `fence` is refused: its slot is not a member, or its incarnation is gone."""
        if fence.slot not in self.members:
            return "not_member"
        if fence.worker_incarnation != self.members[fence.slot]:
            return "fenced_worker"
        return None

    def _push_refusal(self, fence: Fence) -> PushStatus | None:
        """`_refusal`, or a push addressed to an older server incarnation."""
        refusal = self._refusal(fence)
        if refusal is None and fence.server_incarnation != self.incarnation:
            return "fenced_server"
        return refusal

    # ---------------------------------------------------------------- pull
    def pull(self, fence: Fence) -> Pull:
        """The ticket for the sender's clock, when `pull_ready`; the caller then sends `parameters()`."""
        refusal = self._refusal(fence)
        if refusal:
            return Pull(refusal)
        if self.finished:
            return Pull("finished", version=self.version)
        slot = fence.slot
        if self.clocked and self.clocks[slot] < self.version:
            self._skip_ahead(slot)
        clock = self.clocks[slot]
        if not self.pull_ready(clock) or (self.elastic and not self.barrier_open(slot)):
            return Pull("wait", version=self.version, clock=clock)
        held = [t for t in self.leases.held(slot, clock) if not self._is_staged(t)]  # a pushed ticket is never dealt again
        ticket = held[0] if held else self._deal(slot, clock)
        return Pull("ok", ticket, self.version, clock, self.incarnation)

    def barrier_open(self, slot: str) -> bool:
        """elastic_bsp: whether `slot` may pull now: it is in the round (a joiner waits for the next)
        and has not sent its barrier push yet."""
        return self.round.open_for(slot, self.clocks)

    def _skip_ahead(self, slot: str) -> None:
        """Quorum: the sender's clock was applied without it; its unpushed tickets go back to the queue."""
        for ticket in self.leases.held(slot):
            if ticket.clock < self.version:
                self.leases.close(ticket, "requeued")
        self.clocks[slot] = self.version

    def _deal(self, slot: str, clock: int) -> Ticket:
        ranks = list(self.members)
        if self.clocked and clock == self.leases.dealt:
            return next(t for t in self.leases.deal(clock, ranks) if t.holder == slot)
        return self.leases.deal_share(clock, slot, ranks.index(slot), len(ranks))

    # ---------------------------------------------------------------- push
    def push(self, push: Push) -> PushResult:
        status = self._push_refusal(push.fence)
        if push.buffers is not None and status is None:  # the sender's replica, whatever becomes of its gradient
            self.member_buffers[push.fence.slot] = push.buffers.detach().to(torch.float64)
        ticket = None if status else self.leases.find(push.lease_ids)
        if ticket is None and not status:  # applied before; or requeued (by a departure, or by the end)
            status = "duplicate" if self.leases.was_applied(push.lease_ids) else "finished" if self.ended else "stale"
        elif ticket is not None and self._is_staged(ticket):
            status, ticket = "duplicate", None
        elif ticket is not None and ticket.holder != push.fence.slot:
            status, ticket = "stale", None
        if status:
            self.rejected[status] += 1
            return PushResult(status, self.version)
        assert ticket is not None  # no refusal: the push's open ticket was found
        late = self.clocked and ticket.clock < self.version
        if self.finished or late:
            return self._drop(ticket, "finished" if self.finished else "dropped")
        self.clocks[ticket.holder] = ticket.clock + 1
        staged = {"clock": ticket.clock, "rank": ticket.rank, "lease": ticket.leases[0].id,
                  "pulled": push.pulled_version, "loss": float(push.loss), "grad": push.grad.detach().to(torch.float32)}
        if self.elastic and self.round.at.get(ticket.holder) == ticket.clock:
            self.round.staged[ticket.holder] = staged
            updates = self._barrier_ready()
            return PushResult("applied" if updates else "staged", self.version, updates)
        if not self.clocked:
            update = self._apply([staged])
            return PushResult("applied", self.version, (update,))
        self.staged.setdefault(ticket.clock, []).append(staged)
        updates = self._apply_ready()
        return PushResult("applied" if updates else "staged", self.version, updates)

    def _staged_leases(self) -> set[int]:
        return {p["lease"] for pushes in self.staged.values() for p in pushes} | {p["lease"] for p in self.round.staged.values()}

    def _is_staged(self, ticket: Ticket) -> bool:
        """A retried push of a ticket already waiting for its clock."""
        return ticket.leases[0].id in self._staged_leases()

    def _requeue_unpushed(self, holder: str | None = None) -> None:
        """Requeue the open tickets (of `holder`, or everyone's) that no staged push carries: what was
        pushed is good work and stays for its clock."""
        staged = self._staged_leases()
        for ticket in list(self.leases.open.values()):
            if ticket.leases[0].id not in staged and holder in (None, ticket.holder):
                self.leases.close(ticket, "requeued")

    def _drop(self, ticket: Ticket, status: PushStatus) -> PushResult:
        self.leases.close(ticket, "dropped")
        self.rejected[status] += 1
        self.clocks[ticket.holder] = max(self.clocks[ticket.holder], ticket.clock + 1)
        return PushResult(status, self.version)

    def _complete(self, clock: int) -> bool:
        pushes = self.staged.get(clock, [])
        if not pushes:
            return False
        everyone = all(c > clock for c in self.clocks.values())
        if isinstance(self.policy, QuorumConfig):
            assert self.policy.k is not None  # checked in __init__
            return everyone or len(pushes) >= min(self.policy.k, len(self.members))
        return everyone

    def _apply_ready(self) -> tuple[Update, ...]:
        updates = []
        while self.clocked and not self.finished and self._complete(self.version):
            updates.append(self._apply(self.staged.pop(self.version)))
        return tuple(updates)

    # ---------------------------------------------------------------- elastic_bsp's barriers
    def _barrier_ready(self) -> tuple[Update, ...]:
        """Apply the barrier once every member of the round has sent its barrier push (or the round
        lost all its members), and begin the next round with every live member."""
        rnd = self.round
        if self.finished or not self.members or not (rnd.complete() or not rnd.at):
            return ()
        updates: tuple[Update, ...] = ()
        if rnd.staged:
            update = self._apply(list(rnd.staged.values()))
            updates = (replace(update, barrier=rnd.index),)
        self.round = BarrierRound(rnd.index + bool(rnd.staged))
        self._fallback_schedule()
        return updates

    def _fallback_schedule(self) -> None:
        """Every live member's barrier after `r` more iterations: what holds until (unless) the
        coordinator's ZipLine schedule replaces it."""
        assert isinstance(self.policy, ElasticBSPConfig)  # barrier rounds are elastic_bsp's
        self.round.fallback(self.clocks, self.policy.r)
        self.schedules["fallback"] += 1

    def set_schedule(self, index: int, iterations: dict[str, int]) -> bool:
        """The coordinator's ZipLine schedule for round `index`: after how many iterations (1..r) each
        member synchronizes. Taken once, only for the round under way, naming exactly its members, when
        no member has passed the iteration it names yet; otherwise the fallback stays (counted late)."""
        policy = self.policy
        if not (isinstance(policy, ElasticBSPConfig) and self.round.take_schedule(index, iterations, policy.r, self.clocks)):
            self.schedules["late"] += 1
            return False
        self.schedules["zipline"] += 1
        self.schedules["fallback"] -= 1
        return True

    def _apply(self, pushes: list[dict]) -> Update:
        """One optimizer step on the pushes' gradients, summed in rank order, scaled by B / sum(n_i)."""
        pushes = sorted(pushes, key=lambda p: (p["rank"], p["lease"]))
        tickets = [self.leases.open[p["lease"]] for p in pushes]
        samples = sum(t.samples for t in tickets)
        scale = self.global_batch / samples
        lr = lr_at(self.version, self.optimizer_config, self.max_steps)
        self.model.step([p["grad"] for p in pushes], scale, lr)
        staleness = tuple(self.version - p["pulled"] for p in pushes)
        for value in staleness:
            self.staleness[value] = self.staleness.get(value, 0) + 1
        for ticket in tickets:
            self.leases.close(ticket, "applied")
        self.version += 1
        return Update(self.version, lr, scale * sum(p["loss"] for p in pushes), samples, tuple(tickets), staleness,
                      grad_norm=self.model.grad_norm)

    def end(self) -> None:
        """The job is over: pushes still staged for a clock that will never be applied are dropped, and
        tickets nobody pushed are requeued, so that every leased sample is accounted for (applied +
        dropped + requeued = leased). A push that arrives after it is refused as `finished`."""
        self.ended = True
        for p in [p for pushes in self.staged.values() for p in pushes] + list(self.round.staged.values()):
            self.leases.close(self.leases.open[p["lease"]], "dropped")
            self.rejected["finished"] += 1
        self.staged.clear()
        self.round.staged.clear()
        self._requeue_unpushed()

    # ---------------------------------------------------------------- restarts and snapshots
    def new_incarnation(self) -> None:
        """The server restarted from a snapshot: pushes to the previous incarnation are refused from now
        on, so the tickets they would have carried are requeued (what was staged stays)."""
        self.incarnation += 1
        self._requeue_unpushed()

    def begin_run(self) -> None:
        """A new run resumes from this state (`--resume`): the old run's members, clocks and staged
        pushes are gone with it (its end requeued or dropped them; a snapshot's leftovers are requeued
        here), so the first membership epoch of the new run is admitted."""
        self.staged.clear()
        self.round = BarrierRound(self.round.index)  # the first membership begins a round
        self._requeue_unpushed()
        self.members, self.clocks, self.membership_epoch, self.incarnation = {}, {}, 0, 0

    def state_dict(self) -> dict:
        """Everything, as tensors, ints, floats, strings, lists and dicts (`torch.load(weights_only=True)`).
        Its tensors are copies: the caller serializes it outside the server's lock while pushes go on,
        and an optimizer's own `state_dict()` holds the live tensors its next step writes into. (A staged
        push's gradient is shared: nothing writes into it.)"""
        return {"policy": self.policy.policy, "version": self.version, "incarnation": self.incarnation,
                "membership_epoch": self.membership_epoch, **self.model.state_dict(),
                "members": [[slot, inc] for slot, inc in self.members.items()], "clocks": dict(self.clocks),
                "staged": {c: [dict(p) for p in pushes] for c, pushes in self.staged.items()},
                "staleness": dict(self.staleness), "rejected": dict(self.rejected), "leases": self.leases.state_dict(),
                "round": self.round.state_dict(), "schedules": dict(self.schedules),
                "buffers": {slot: b.clone() for slot, b in self.member_buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["policy"] != self.policy.policy or not self.model.fits(state):
            raise ValueError(f"a snapshot of policy {state['policy']!r} with shards {state['bounds']} does not fit "
                             f"this server ({self.policy.policy!r}, shards {self.model.bounds})")
        self.model.load_state_dict(state)
        self.version, self.incarnation = state["version"], state["incarnation"]
        self.membership_epoch = state["membership_epoch"]
        self.members = {slot: inc for slot, inc in state["members"]}
        self.clocks = dict(state["clocks"])
        self.staged = {c: [dict(p) for p in pushes] for c, pushes in state["staged"].items()}
        self.staleness, self.rejected = dict(state["staleness"]), dict(state["rejected"])
        self.leases.load_state_dict(state["leases"])
        self.round = BarrierRound.from_state(state["round"])
        self.schedules = dict(state["schedules"])
        self.member_buffers = {slot: b.clone() for slot, b in state.get("buffers", {}).items()}
