"""A replica's group in each membership epoch: leave the old one, form the new one (and the background
kind's own), abort it on the coordinator's word, and settle it once its first step committed.

`EpochGroup` owns the communicator and the bytes sent through earlier ones; the replica decides when an
epoch is entered and what its entry agrees (actors/training/entry.py).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from actors.plan import Plan
from actors.transport import collective
from actors.transport.comm import BaseCommunicator, GlooCommunicator, GroupSpec, Handle, NoGroup, form_in_thread, make_communicator
from algorithms.policies.base import AlgorithmImpl
from core.schema import JobConfig

log = logging.getLogger(__name__)


@runtime_checkable
class Closing(Protocol):
    """A group with connections of its own to close (every backend's; `BaseCommunicator` does not declare it)."""

    def close(self) -> None: ...


@runtime_checkable
class Reducing(Protocol):
    """A group that reduces (every backend's; `NoGroup`, of the kinds without one, does not)."""

    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle: ...


def close_group(comm: BaseCommunicator) -> None:
    """Close a membership epoch's group."""
    if isinstance(comm, Closing):
        comm.close()


class EpochGroup:
    """The communicator of this member's current membership epoch."""

    def __init__(self, cfg: JobConfig, comm_address: str, tell_fallback: Callable[[int, str, str], None]) -> None:
        """`comm_address`: where this member's group traffic leaves from; `tell_fallback(epoch, group, reason)`:
        rank 0 tells the coordinator that its group reduces through gloo although all its members share a node."""
        self.comm: BaseCommunicator | None = None
        self._cfg = cfg
        self.comm_address = comm_address
        self._tell_fallback = tell_fallback
        self.bytes_before = 0
        """Bytes this member sent in earlier membership epochs (each epoch's communicator counts its own)."""
        self._settle_due = False
        """The epoch's group has committed no step yet: its first commit settles it (`comm.settled`)."""

    def bytes_sent(self, impl: AlgorithmImpl) -> int:
        return self.bytes_before + impl.bytes_sent

    def leave(self, impl: AlgorithmImpl, reason: str) -> None:
        """The epoch is over: the policy lets go of its group, which closes."""
        comm, self.comm = self.comm, None
        if comm is not None:
            impl.on_epoch_end(reason)
            self.bytes_before += comm.bytes_sent
            collective.withdraw(comm)
            close_group(comm)

    def form(self, spec: GroupSpec, plan: Plan, forms: bool, superseded: Callable[[], bool]) -> BaseCommunicator | None:
        """The epoch's group (`NoGroup` where the policy's entry `forms` none); None where a newer
        membership superseded it while forming. Raises CommError where it cannot be formed."""
        comm = form_group(spec, superseded) if forms else NoGroup(spec)
        if comm is not None:
            self.comm = comm
            self._prepare(comm, plan)
        return comm

    def failed(self, impl: AlgorithmImpl, reason: str) -> None:
        """Entering the epoch failed: the policy lets go, and the group closes."""
        impl.on_epoch_end(reason)
        comm, self.comm = self.comm, None
        if comm is not None:
            close_group(comm)

    def entered(self) -> None:
        self._settle_due = True

    def settle(self) -> None:
        """The epoch's first step committed: the group settles, off the next re-form's path."""
        if self._settle_due and self.comm is not None:
            self._settle_due = False
            self.comm.settled()

    def abort(self, plan: Plan | None, membership_epoch: int, reason: str) -> BaseCommunicator | None:
        """Abort the group if it belongs to `membership_epoch` or an earlier one; returns it then."""
        comm = self.comm
        if comm is None or plan is None or plan.membership_epoch > membership_epoch:
            return None
        comm.abort(reason)
        return comm

    def background_group(self, plan: Plan | None, membership_epoch: int) -> BaseCommunicator | None:
        """The background kind's own group of `membership_epoch` (`<group>/bg`), formed in the policy's
        entry thread; None once a newer epoch superseded it."""
        comm = self.comm
        if comm is None or plan is None or plan.membership_epoch != membership_epoch:
            return None
        spec = dataclasses.replace(comm.spec, name=comm.spec.name + "/bg")
        group = form_group(spec, lambda: self.comm is not comm)
        if group is not None:
            self._prepare(group, plan)
        return group

    def withdraw(self) -> None:
        """The run ends: the workload's `ray.util.collective` calls no longer reach the group."""
        collective.withdraw(self.comm)

    def _prepare(self, comm: BaseCommunicator, plan: Plan) -> None:
        """Say why a node's group reduces through gloo (rank 0 tells the coordinator: shared memory was
        unavailable to one of its members); model `faults.comm_latency_s` on every operation, and in the
        lab each link's modelled latency."""
        if isinstance(comm, GlooCommunicator) and comm.shm_fallback is not None and comm.rank == 0:
            self._tell_fallback(plan.membership_epoch, comm.name, comm.shm_fallback)
        comm.latency_s = self._cfg.faults.comm_latency_s
        network = self._cfg.network
        if network.lab:
            nodes = [network.node_of(slot) for slot in plan.members]
            matrix = [[network.link(a, b).latency_ms / 1e3 for b in nodes] for a in nodes]
            comm.link_latency_s = matrix if any(any(row) for row in matrix) else None


def largest_reduce(model: torch.nn.Module, metrics: int = 0) -> int:
    """The most bytes a policy all-reduces at once: every trainable parameter in one flat tensor of at
    least float32 (its gradients, or the parameters averaged), and the step's tail in float64 (3 numbers
    and the workload's `metrics` step metrics)."""
    return sum(p.numel() * max(p.element_size(), 4) for p in model.parameters() if p.requires_grad) + (3 + metrics) * 8


def form_group(spec: GroupSpec, superseded: Callable[[], bool]) -> BaseCommunicator | None:
    """Form one membership epoch's group in a helper thread (`form_in_thread`); None if it is
    `superseded()` meanwhile: a member that waited for a superseded epoch goes straight to the next
    one. After `spec.forming_s` (plus a margin) the attempt fails with CommTimeout. The helper thread
    forms on the caller's GPU (a thread's current CUDA device is its own: replicas in threads of one
    process each hold their own GPU)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def build() -> BaseCommunicator:
        if device is not None:
            torch.cuda.set_device(device)
        return make_communicator(spec)
    return form_in_thread(spec, build, superseded)
