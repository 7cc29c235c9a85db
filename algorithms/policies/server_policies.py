"""The worker side of the server policies (asp, ssp, quorum, elastic_bsp): pull, train on the lease, push. Pure: no Ray.

A member of a server kind does not cut its own share of a global batch and never talks to its peers:
each step it pulls from the parameter server (which `ServerClient` reaches: a Ray actor in
actors/server/parameter_server.py, or an in-process host in tests), loads the parameters it got, trains on
the samples of the ticket that came with them, and pushes the flat gradient back with the ticket's
lease ids. The update rule lives in algorithms/policies/server.py; history, the stop and the final model come
from the server (algorithms/policies/base.py, kind `server`).

A pull that the server answers "wait" (ssp's bound, quorum's clock not yet applied, not admitted to
the membership yet) is not an error: `step_samples` returns no samples and the worker's loop comes
back, so it notices new plans and stops in between. The member's step counter is its clock: the
number of pushes it made, not the job's step (the server's version).
"""
from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from algorithms.policies.base import Algorithm, AlgorithmImpl, StepVote, VoteDraft, register
from algorithms.policies.server_messages import Fence, Pull, Push, PushResult
from algorithms.rules.kinds import SERVER

log = logging.getLogger(__name__)
PULL_WAIT_S = 0.5
"""How long one pull may wait at the server before the worker's loop looks at its plans again."""


class ServerClient(Protocol):
    """How a member reaches the parameter server (every call has a timeout)."""

    def pull(self, fence: Fence, wait_s: float) -> tuple[Pull, torch.Tensor | None]:
        """The pull's answer and, when it is `ok` or `finished`, the flat float32 parameters."""
        ...

    def push(self, push: Push) -> PushResult: ...

    def push_pull(self, push: Push, wait_s: float) -> tuple[PushResult, Pull | None, torch.Tensor | None]:
        """The push, then (unless the push was refused or the job finished) the sender's next pull, in
        one call: one round trip a step instead of two."""
        ...


class ServerImpl(AlgorithmImpl):
    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.client: ServerClient | None = None
        self.slot, self.incarnation = "", 0
        self.pulled: Pull | None = None
        self.server_incarnation = 0
        self.finished = False
        self._loss = 0.0
        self.results: dict[str, int] = {}
        """This member's pushes by the server's answer (applied, staged, dropped, fenced_*, ...)."""
        self._next: tuple[Pull, torch.Tensor | None] | None = None
        """The next step's pull, answered with the last push."""

    def connect(self, client: ServerClient, slot: str, incarnation: int) -> None:
        """The server this member pulls from, and who it is (its slot and worker incarnation)."""
        self.client, self.slot, self.incarnation = client, slot, incarnation

    def _fence(self) -> Fence:
        epoch = self.epoch.membership_epoch if self.epoch else 0
        return Fence(epoch, self.slot, self.incarnation, self.server_incarnation)

    def step_samples(self, step: int) -> np.ndarray | None:
        """Pull: the fresh parameters go into the model, the ticket's sample ids are this step's batch.
        An empty array when there is nothing to train now (wait, refused, or finished)."""
        if self.client is None:
            raise RuntimeError(f"policy {self.algorithm.name!r} needs a parameter server; none was connected")
        pull, flat = self._next or self.client.pull(self._fence(), PULL_WAIT_S)
        self._next = None
        if flat is not None:
            self._load(flat)
        if pull.status == "finished":
            self.finished = True
        if pull.status != "ok":
            return np.empty(0, dtype=np.int64)
        assert pull.ticket is not None  # an ok pull carries its ticket
        self.pulled, self.server_incarnation = pull, pull.server_incarnation
        return np.asarray([i for lease in pull.ticket.leases for i in lease.ids], dtype=np.int64)

    def _load(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat.to(dtype=torch.float32), list(self.model.parameters()))

    def apply_update(self, step: int, lr: float) -> None:
        """Push the flat gradient (the loss was weighted by n_i / B, as for BSP); the server applies it
        with its own learning rate, which counts versions."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads])
        buffers = list(self.model.buffers())  # they travel with the push: the final model takes them from the members
        held = torch.cat([b.detach().reshape(-1).to(torch.float64).cpu() for b in buffers]) if buffers else None
        pull, self.pulled = self.pulled, None
        # an update follows a step that trained, so on an ok pull (its ticket set) from a connected server
        assert self.client is not None and pull is not None and pull.ticket is not None
        result, nxt, params = self.client.push_pull(Push(self._fence(), pull.ticket.lease_ids, pull.version, flat, self._loss,
                                                         held), PULL_WAIT_S)
        if nxt is not None:
            self._next = (nxt, params)
        self.results[result.status] = self.results.get(result.status, 0) + 1
        if result.status == "finished":
            self.finished = True
        self.optimizer.zero_grad(set_to_none=True)

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        self._loss = float(draft.loss)  # the share-weighted loss travels with the push
        return StepVote.local(draft)

    def stop_requested(self) -> bool:
        return self.finished

    def on_epoch_end(self, reason: str) -> None:
        """A pull answered with the last push stays good across epochs (the server fences by slot and
        worker incarnation, not by epoch): it is kept."""

    def state_dict(self) -> dict:
        return {"results": dict(self.results)}


class _ServerAlgorithm(Algorithm):
    kind = SERVER
    impl = ServerImpl


@register
class ASP(_ServerAlgorithm):
    name = "asp"


@register
class SSP(_ServerAlgorithm):
    name = "ssp"


@register
class Quorum(_ServerAlgorithm):
    name = "quorum"


@register
class ElasticBSP(_ServerAlgorithm):
    name = "elastic_bsp"
