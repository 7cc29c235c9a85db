"""The policy kinds: what each kind of policy means to the control plane and to the step loop, without torch.

A kind is an object (`Kind`): its membership-epoch entry (`Entry`), who reports history (`Reporter`),
what the final model is (`FinalModel`) and the other answers that follow from it, each under a name that
says what it decides (`runs_server`, `local_mean`, `new_epoch_each_plan`, ...). Code asks the kind a
question; it never compares a kind's name (tests/unit/test_kinds.py scans the packages for that). Every
policy names its kind in the policy table (core/schema/policies.py `POLICIES`); `POLICY_KINDS` turns each
row's name into the object, and each policy class declares the same object as its `kind`.

The coordinator decides from a policy's kind alone, so this module is all it imports of the policies:
importing torch would cost every job's start about two seconds before its first worker is asked for.
The names (`str(kind)`, `entry.value`, ...) are what configs, logs and messages say.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from core.schema import POLICIES


class _Named(Enum):
    """An enum whose members read as their value wherever they are printed (events, errors, logs); a member
    equals only itself, never its name."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Entry(_Named):
    """How a member enters a membership epoch (actors/training/entry.py)."""

    REPLICATED = "replicated"
    """The members agree on the newest committed state (step, checksum); the lowest-ranked holder of the
    newest broadcasts it and every member that differs loads it."""
    AVERAGE = "average"
    """Nobody's live replica is overwritten: split exchanges are undone, a member without state loads the
    newest holder's, those behind skip ahead."""
    SERVER = "server"
    """The members pull from the parameter server: nothing to reconcile among them."""
    NONE = "none"
    """Nothing to reconcile (the background kind's rounds run in their own group)."""
    SHARDED = "sharded"
    """Replica groups (`sharding.group_size` > 1): the members agree on the newest state held whole among
    their shards and copies, and the replica is re-cut into the new epoch's groups from their memory."""

    @property
    def forms_group(self) -> bool:
        """Whether the members form a collective group for the epoch (else a group-less epoch)."""
        return self in (Entry.REPLICATED, Entry.AVERAGE, Entry.SHARDED)

    @property
    def agrees_on_step(self) -> bool:
        """Whether the members agree on the newest committed step at entry, which rank 0 tells history."""
        return self in (Entry.REPLICATED, Entry.SHARDED)


class Reporter(_Named):
    """Who reports history's records."""

    RANK0 = "rank0"
    """Rank 0 reports every committed step (the members are in lockstep)."""
    EACH = "each"
    """Every member reports its own steps; the job's step is the slowest live member's."""
    SERVER = "server"
    """The parameter server reports each version it applies."""

    @property
    def each_member_reports(self) -> bool:
        return self is Reporter.EACH

    @property
    def rank0_reports(self) -> bool:
        return self is Reporter.RANK0

    @property
    def server_reports(self) -> bool:
        return self is Reporter.SERVER

    def reports_from(self, rank: int) -> bool:
        """Whether a member of `rank` reports its steps."""
        return self.each_member_reports or (self.rank0_reports and rank == 0)


class FinalModel(_Named):
    """What the job's final model (and a checkpoint) is."""

    RANK0 = "rank0"
    """Rank 0's committed state (every member holds the same at a commit point)."""
    SERVER = "server"
    """The parameter server's state (the server checkpoints it; members hold none)."""
    AVERAGE = "average"
    """The average of the members' replicas (they differ)."""

    @property
    def averages_replicas(self) -> bool:
        return self is FinalModel.AVERAGE

    @property
    def from_server(self) -> bool:
        return self is FinalModel.SERVER


@dataclass(frozen=True, eq=False)
class Kind:
    """One kind of policy and every answer that follows from it. The five instances below are all there are;
    a kind equals only itself."""

    name: str
    entry: Entry
    reporter: Reporter
    final_model: FinalModel
    traffic: str
    """What its members' bytes carry (the `bytes` metric's `kind` label)."""
    runs_server: bool = False
    """The job runs a server actor (the parameter server, or the lease dispenser) that deals the samples."""
    dispenses_leases: bool = False
    """That server is the lease dispenser (with EASGD's central copy), not a parameter server: it has no
    versions, requeues what it holds when closed, and keeps a leaver until it leaves."""
    server_holds_state: bool = False
    """The server holds the training state: members push every step and hold none; the server counts the
    versions toward `stop.max_steps` and says when to stop."""
    local_mean: bool = False
    """Members update their own replica, each on its mean loss; the others weight each member's loss by
    its share of the global batch, so that summing is the global-batch mean."""
    reduces_every_step: bool = False
    """Every step is one reduction over all members (its vote counts the whole global batch)."""
    new_epoch_each_plan: bool = False
    """Every new plan is a new membership epoch, and the old one is aborted: the members cannot switch
    plans together at a step (no vote is reduced over all of them)."""
    background_rounds: bool = False
    """Rounds run off the foreground, in a group of their own per membership epoch; a joiner holds state
    once a round hands it some (not at its epoch's first commit); the replicas' newest average is
    evaluated, by rank 0 alone."""

    @property
    def counts_steps(self) -> bool:
        """Whether a member's own step counts toward `stop.max_steps` (a server that holds the state counts versions)."""
        return not self.server_holds_state

    @property
    def members_hold_state(self) -> bool:
        """Whether members hold training state of their own (joiners then start stateless until they load one)."""
        return not self.server_holds_state

    @property
    def pushes_each_step(self) -> bool:
        """Whether a member's step waits on a push to the server (which has no collective timeout)."""
        return self.server_holds_state

    @property
    def server_role(self) -> str:
        """What its server actor is called in events and errors."""
        return "lease dispenser" if self.dispenses_leases else "parameter server"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Kind({self.name!r})"

    def __reduce__(self) -> tuple[Callable[[str], Kind], tuple[str]]:
        """Pickled by name (a Ray call, a spawned process): the other side gets its own one instance."""
        return kind_named, (self.name,)


SYNCHRONOUS = Kind("synchronous", Entry.REPLICATED, Reporter.RANK0, FinalModel.RANK0, "gradients", reduces_every_step=True)
PERIODIC = Kind("periodic", Entry.REPLICATED, Reporter.RANK0, FinalModel.RANK0, "rounds", local_mean=True)
SERVER = Kind("server", Entry.SERVER, Reporter.SERVER, FinalModel.SERVER, "pushes", runs_server=True, server_holds_state=True)
DECENTRALIZED = Kind("decentralized", Entry.AVERAGE, Reporter.EACH, FinalModel.AVERAGE, "exchanges",
                     local_mean=True, new_epoch_each_plan=True)
BACKGROUND = Kind("background", Entry.NONE, Reporter.EACH, FinalModel.AVERAGE, "background rounds",
                  runs_server=True, dispenses_leases=True, local_mean=True, background_rounds=True)
KINDS: dict[str, Kind] = {kind.name: kind for kind in (SYNCHRONOUS, PERIODIC, SERVER, DECENTRALIZED, BACKGROUND)}
"""Every kind by its name (the policy table's `kind` column)."""


def kind_named(name: str) -> Kind:
    return KINDS[name]

POLICY_KINDS: dict[str, Kind] = {row.name: KINDS[row.kind] for row in POLICIES}
"""Every built-in policy's kind, from the policy table (core/schema/policies.py `POLICIES`); each policy class
declares the same as its `kind`."""


class KindTraits:
    """The kind-derived answers; `Algorithm` has them, and the coordinator holds just these."""

    kind: Kind

    @property
    def entry(self) -> Entry:
        return self.kind.entry

    @property
    def reporter(self) -> Reporter:
        return self.kind.reporter

    @property
    def final_model(self) -> FinalModel:
        return self.kind.final_model

    @property
    def local_mean(self) -> bool:
        return self.kind.local_mean

    @property
    def counts_steps(self) -> bool:
        return self.kind.counts_steps


class PolicyTraits(KindTraits):
    """A policy as the coordinator sees it: its name and kind."""

    def __init__(self, name: str) -> None:
        if name not in POLICY_KINDS:
            raise KeyError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICY_KINDS))}")
        self.name = name
        self.kind = POLICY_KINDS[name]

    def __repr__(self) -> str:
        return f"PolicyTraits({self.name!r}, kind={self.kind!r})"
