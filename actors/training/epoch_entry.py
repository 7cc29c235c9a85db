"""Entering a membership epoch: a replica leaves its old group, switches policy where the plan says, forms
the new group and enters it (actors/training/entry.py: the members agree on where they stand), and tells the
coordinator what the entry agreed.

`EpochEntry` reaches the replica's parts through the replica (actors/training/parts.py `ReplicaParts`); a member whose
group fails to form waits for a newer plan.
"""
from __future__ import annotations

import functools

from actors.plan import Plan
from actors.training.entry import enter, enter_switched
from actors.training.epoch_group import largest_reduce
from actors.training.parts import ReplicaParts
from actors.transport import collective
from actors.transport.comm import CommError, GroupSpec
from algorithms.policies.base import EpochInfo


class EpochEntry:
    """How one replica enters each membership epoch."""

    def __init__(self, replica: ReplicaParts) -> None:
        self._r = replica

    def enter(self, plan: Plan) -> bool:
        """Leave the old group, switch policy where the plan says, form the new group and enter it; False
        where it failed to form or a newer membership superseded it (the loop waits for a newer plan)."""
        r = self._r
        if r.shards is not None:
            r.shards.leave()  # torch forgets the old group before it is released
        r.group.leave(r.policy.impl, f"membership epoch {plan.membership_epoch} begins")
        if plan.policy is not None:  # the coordinator switched the policy (the online trial of `sync.auto`)
            r.switch_policy(plan.policy["sync"], plan.policy["compression"])
        rank = plan.rank_of(r.slot)
        if rank is None:
            raise RuntimeError(f"{r.slot} is not a member of plan {plan.version}")
        spec = GroupSpec(plan.store_host, plan.store_port, plan.group_name, rank, len(plan.members), plan.timeout_s,
                         plan.backend, r.group.comm_address, secret=r.spec.secret,
                         reduce_bytes=largest_reduce(r.training.model, len(r.metrics.names)),
                         formation_timeout_s=plan.formation_timeout_s)
        r.joining()
        previous = r.trained_plan
        algorithm = r.policy.algorithm
        try:
            comm = r.group.form(spec, plan, algorithm.entry.forms_group, functools.partial(self._superseded, plan))
            if comm is None:
                return False  # a newer membership arrived while forming: go straight to it
            source = enter(algorithm.entry, r.committed, comm)
            algorithm, impl = r.policy.algorithm, r.policy.impl  # a state loaded may have switched the policy
            if plan.policy is not None and plan.policy.get("fresh"):
                switched = enter_switched(r.committed, comm)
                source = source if switched is None else switched
            if impl.commit_mark is None:
                r.samples.forget()  # a step that failed everywhere is redone: its samples were not applied
            elif r.training.provisional(impl) and previous is not None:  # local steps kept: the departed members' shares are lost
                r.samples.drop_departed(previous, plan, r.mark() + 1, r.training.provisional_cursors(impl, previous.global_batch),
                                        r.feed.ids_of, plan.rank_of(r.slot) == 0)
            if rank == 0 and algorithm.entry.agrees_on_step:  # history takes the agreed step, and any it lacks
                r.reporter.agree(plan.membership_epoch, r.mark(), plan.history_step)
        except CommError as err:
            r.failed_with(str(err))
            r.group.failed(r.policy.impl, str(err))
            return False
        r.policy.impl.on_membership(r.faults.wrap(comm, lambda: r.training.step),
                                    EpochInfo(rank, len(plan.members), plan.members, plan.global_batch,
                                              plan.membership_epoch, plan.nodes))
        if r.training.step == r.mark():
            r.trained_under(plan)  # else the kept local steps were trained under the plan before
        collective.publish(comm, r.policy.cfg.sync.policy)  # the workload's `ray.util.collective` calls reach it
        r.group.entered()
        if source is not None:
            r.link.state_received(r.slot, plan.membership_epoch, plan.members[source], r.training.step)
            r.faults.maybe_fire("join", r.training.step)  # a joiner that has its state but has not trained yet
        return True

    def _superseded(self, plan: Plan) -> bool:
        latest = self._r.plans.latest
        return latest is not None and latest.version > plan.version and latest.group_name != plan.group_name
