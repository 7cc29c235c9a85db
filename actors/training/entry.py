"""Entering a membership epoch: how the members of a new group agree on where they stand.

Which mode a policy uses follows from its kind (algorithms/policies/base.py):

- `replicated` (synchronous and periodic kinds): the members exchange (committed step, checksum
  of the committed state, current step). Gloo can finish a vote on some ranks and fail it on
  others, so members may hold different committed states: the newest wins, and its lowest-ranked
  holder broadcasts it to every member whose committed state differs (for a policy whose replicas
  differ at a commit point by design, streaming DiLoCo with several fragments or alpha < 1: every
  member at an older committed step; the others keep their own progress). A member whose committed
  state is the newest but that trained past it (periodic local steps after a round some others
  missed) rewinds to it, so everyone stands at one step. When every member reports the same
  triple (a periodic round that failed everywhere), nothing moves: the local steps are kept and
  the round is redone.
- `average` (decentralized): no live replica is overwritten; the members undo the terms of split
  exchanges (algorithms/policies/gossip.py), a member that never held state loads the lowest-ranked holder
  of the newest step's, and those behind skip ahead to the newest step.
- `sharded` (replica groups): the members agree on the newest state held whole among their shards and
  their copies of their neighbours', and the replica is re-cut into the new epoch's groups from their
  memory (actors/training/sharded_replica.py); those at another step take the position of one at that state.
- `none` (background): nothing to reconcile.
- `server`: the state lives on the parameter server; nothing to reconcile among the members.

Each entry returns the slot the member loaded state from (for the reshape event), or None.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from actors.training.state_transfer import broadcast_state
from algorithms.rules.kinds import Entry


class Member(Protocol):
    """What an entry needs of a replica (actors/training/replica.py)."""

    @property
    def step(self) -> int: ...
    @property
    def holds_state(self) -> bool: ...
    @property
    def impl(self) -> Any: ...
    @property
    def plan(self) -> Any: ...

    def committed_view(self) -> tuple[int, int]: ...
    def committed_state(self) -> dict[str, Any]: ...
    def load_received(self, state: dict[str, Any]) -> None: ...
    def rewind(self) -> None: ...
    def skip_to(self, step: int) -> None: ...
    def enter_shards(self, comm: Any) -> int | None: ...


def enter(mode: Entry, member: Member, comm: Any) -> int | None:
    """Run the entry `mode` over `comm`; returns the source rank when this member loaded state."""
    entry = ENTRIES.get(mode)
    return None if entry is None else entry(member, comm)


def enter_replicated(member: Member, comm: Any) -> int | None:
    mark, digest = member.committed_view()
    mine = torch.tensor([mark, digest, member.step], dtype=torch.int64, device=comm.device)
    views = [torch.zeros(3, dtype=torch.int64, device=comm.device) for _ in range(comm.world_size)]
    comm.all_gather(views, mine).wait()
    if all(torch.equal(v, views[0]) for v in views):
        return None  # one committed state and one step everywhere: keep it (and any local steps)
    views = [v.cpu() for v in views]
    newest = max(int(v[0]) for v in views)
    src = min(r for r, v in enumerate(views) if int(v[0]) == newest)
    if getattr(member.impl, "replicas_agree_at_commit", True):
        differs = [not torch.equal(v[:2], views[src][:2]) for v in views]
    else:  # replicas differ at a commit point by design (streaming fragments): only those behind load
        differs = [int(v[0]) != newest for v in views]
    loaded = None
    if any(differs):  # every member computes the same `differs`: all take part in the broadcast
        loaded = _broadcast_state(member, comm, src) if differs[comm.rank] else _broadcast_state(member, comm, src, keep=True)
    if loaded is None and int(views[comm.rank][2]) != newest:
        member.rewind()  # committed state is the newest, but it trained past it: back to it
    return loaded


def enter_switched(member: Member, comm: Any) -> int | None:
    """The first epoch of a policy switched to mid-run (`Plan.policy` fresh): once the members have
    entered, every one takes rank 0's committed state, so state a policy keeps per member (a periodic
    policy's inner optimizer state, which the checksum of the parameters does not see) is the same on
    all of them from the switch on. Returns 0 where this member loaded it."""
    return _broadcast_state(member, comm, 0, keep=comm.rank == 0)


def _broadcast_state(member: Member, comm: Any, src: int, keep: bool = False) -> int | None:
    """The committed state of `src`, to every member (a collective, in chunks of bounded size:
    actors/training/state_transfer.py); loaded unless `keep`."""
    state = member.committed_state() if comm.rank == src else None
    received = broadcast_state(comm, src, state, keep=keep)
    if received is None:
        return None
    member.load_received(received)
    return src


def enter_average(member: Member, comm: Any) -> int | None:
    """Decentralized entry: no live replica is overwritten. The members gather (holds state, step,
    newest exchange launched, newest applied); each undoes what split exchanges left (the policy's
    `reconcile`); a member that never held state (a joiner; on a resume, all but the one given the
    checkpoint) loads the state of the lowest-ranked holder of the newest step; the members behind
    skip ahead to the newest step, counting their skipped shares as dropped."""
    mine = torch.tensor([1 if member.holds_state else 0, member.step, *member.impl.exchange_report()],
                        dtype=torch.int64, device=comm.device)
    gathered = [torch.zeros_like(mine) for _ in range(comm.world_size)]
    comm.all_gather(gathered, mine).wait()
    views: list[list[int]] = [v.cpu().tolist() for v in gathered]
    members = member.plan.members
    member.impl.reconcile({members[r]: tuple(v[2:]) for r, v in enumerate(views)})
    newest = max(v[1] for v in views)
    holders = [r for r, v in enumerate(views) if v[0]]
    loaded = None
    if holders and len(holders) < len(views):  # someone is new and someone holds state: all take part
        src = min(holders, key=lambda r: (-views[r][1], r))
        loaded = _broadcast_state(member, comm, src, keep=bool(views[comm.rank][0]))
    member.skip_to(newest)
    return loaded


def enter_sharded(member: Member, comm: Any) -> int | None:
    return member.enter_shards(comm)


ENTRIES = {Entry.REPLICATED: enter_replicated, Entry.AVERAGE: enter_average, Entry.SHARDED: enter_sharded}
"""The entries that reconcile the members (the others have nothing to reconcile)."""
