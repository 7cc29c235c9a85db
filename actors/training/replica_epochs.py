"""A replica's membership epochs: leave the old group, form the new one (and the background kind's own),
enter it (actors/training/entry.py) and tell the coordinator what the entry agreed.

`EpochEntry` is a mixin of `Replica` (actors/training/replica.py): its run thread calls `_enter_epoch` whenever its
plan names a group it is not in; a member whose group fails to form waits for a newer plan.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from actors.plan import Plan
from actors.training.entry import enter, enter_switched
from actors.training.replica_base import close_group
from actors.training.replica_state import CommittedState
from actors.transport import collective
from actors.transport.comm import BaseCommunicator, CommError, GlooCommunicator, GroupSpec, NoGroup, form_in_thread, make_communicator
from algorithms.policies.base import EpochInfo

log = logging.getLogger(__name__)


class EpochEntry(CommittedState):
    """A `Replica`'s membership epochs: leave, form and enter each epoch's group (the entry moves it
    to another committed state through `CommittedState`)."""

    def _enter_epoch(self, plan: Plan) -> bool:
        if self.comm is not None:
            self.impl.on_epoch_end(f"membership epoch {plan.membership_epoch} begins")
            self.bytes_before += self.comm.bytes_sent
            collective.withdraw(self.comm)
            close_group(self.comm)
        self.comm = None
        if plan.policy is not None:  # the coordinator switched the policy (the online trial of `sync.auto`)
            self._switch_policy(plan.policy["sync"], plan.policy["compression"])
        rank = self._rank_in(plan)
        spec = GroupSpec(plan.store_host, plan.store_port, plan.group_name, rank, len(plan.members), plan.timeout_s,
                         plan.backend, self.comm_address, secret=self.spec.secret,
                         reduce_bytes=largest_reduce(self.model, len(self.metric_names)))
        self.state = "joining"
        self._enter_phase("joining")
        previous = self.trained_plan
        try:
            comm = NoGroup(spec) if self.algorithm.entry in ("server", "none") else self._form(spec, plan)
            if comm is None:
                return False  # a newer membership arrived while forming: go straight to it
            self.comm = comm
            self._transport_fallback(comm, plan.membership_epoch)
            self._model_latency(comm, plan)
            source = enter(self.algorithm.entry, self, comm)
            if plan.policy is not None and plan.policy.get("fresh"):
                switched = enter_switched(self, comm)
                source = source if switched is None else switched
            if self.impl.commit_mark is None:
                self._pending_ids = []  # a step that failed everywhere is redone: its samples were not applied
            elif self.step > self.impl.commit_mark:
                self._count_dropped(previous, plan)  # local steps kept: the departed members' shares are lost
            if rank == 0 and self.algorithm.entry == "replicated":  # history takes the agreed step, and any it lacks
                missing = tuple(r for r in self.kept if r["step"] > plan.history_step)
                self._agreement = (plan.membership_epoch, self._mark(), missing)  # sent ahead of the next report
        except CommError as err:
            self.cause = str(err)
            self.impl.on_epoch_end(str(err))
            if self.comm is not None:
                close_group(self.comm)
                self.comm = None
            return False
        self.impl.on_membership(self.faults.wrap(comm, lambda: self.step),
                                EpochInfo(rank, len(plan.members), plan.members, plan.global_batch, plan.membership_epoch,
                                          plan.nodes))
        if self.step == self._mark():
            self.trained_plan = plan  # else the kept local steps were trained under the plan before
        collective.publish(comm, self.cfg.sync.policy)  # the workload's `ray.util.collective` calls reach it
        self._settle_due = True
        if source is not None:
            self.link.state_received(self.slot, plan.membership_epoch, plan.members[source], self.step)
            self.faults.maybe_fire("join", self.step)  # a joiner that has its state but has not trained yet
        return True

    def _form(self, spec: GroupSpec, plan: Plan) -> BaseCommunicator | None:
        def superseded() -> bool:
            latest = self.plans.latest
            return latest is not None and latest.version > plan.version and latest.group_name != plan.group_name
        return form_group(spec, superseded)

    def _background_group(self, epoch: EpochInfo) -> BaseCommunicator | None:
        """The background kind's own group of membership epoch `epoch` (`<group>/bg`), formed in the
        policy's entry thread; None once a newer epoch superseded it."""
        comm = self.comm
        if comm is None or self.plan is None or self.plan.membership_epoch != epoch.membership_epoch:
            return None
        spec = dataclasses.replace(comm.spec, name=comm.spec.name + "/bg")
        group = form_group(spec, lambda: self.comm is not comm)
        if group is not None and self.plan is not None:
            self._transport_fallback(group, epoch.membership_epoch)
            self._model_latency(group, self.plan)
        return group

    def _transport_fallback(self, comm: BaseCommunicator, epoch: int) -> None:
        """Rank 0 of a group whose members all run on this node but all-reduce through gloo tells the
        coordinator why (a `transport` event): shared memory was unavailable to one of them."""
        if isinstance(comm, GlooCommunicator) and comm.shm_fallback is not None and comm.rank == 0:
            self.link.transport_fallback(self.slot, epoch, comm.name, comm.shm_fallback)

    def _model_latency(self, comm: BaseCommunicator, plan: Plan) -> None:
        """`faults.comm_latency_s` on every operation, and in the lab each link's modelled latency."""
        comm.latency_s = self.cfg.faults.comm_latency_s
        network = self.cfg.network
        if network.lab:
            nodes = [network.node_of(slot) for slot in plan.members]
            matrix = [[network.link(a, b).latency_ms / 1e3 for b in nodes] for a in nodes]
            comm.link_latency_s = matrix if any(any(row) for row in matrix) else None

    def _background_failed(self, error: str) -> None:
        """A background round failed: the coordinator probes the members and re-forms the group."""
        try:
            self.link.collective_failed(self.slot, self.plan.membership_epoch if self.plan else 0, error[:300])
        except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting
            log.warning("could not tell the coordinator that a background round failed: %s", failure)


def largest_reduce(model: torch.nn.Module, metrics: int = 0) -> int:
    """The most bytes a policy all-reduces at once: every trainable parameter in one flat tensor of at
    least float32 (its gradients, or the parameters averaged), and the step's tail in float64 (3 numbers
    and the workload's `metrics` step metrics)."""
    return sum(p.numel() * max(p.element_size(), 4) for p in model.parameters() if p.requires_grad) + (3 + metrics) * 8


def form_group(spec: GroupSpec, superseded: Callable[[], bool]) -> BaseCommunicator | None:
    """Form one membership epoch's group in a helper thread (`form_in_thread`); None if it is
    `superseded()` meanwhile: a member that waited for a superseded epoch goes straight to the next
    one. After `spec.timeout_s` (plus a margin) the attempt fails with CommTimeout."""
    return form_in_thread(spec, lambda: make_communicator(spec), superseded)


