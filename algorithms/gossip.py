"""Decentralized (gossip) policies: `dpsgd` and `dadam`. Pure torch; the communicator is given.

Each step every member i exchanges its whole parameter vector with the peers of its topology's row
(algorithms/topologies.py), point to point: at the start of the step (`before_forward`) it sends
its flat x_i to every rank whose row holds it (`sends_to`) and posts a receive for every peer j of
its own row, so the exchange overlaps forward and backward. The gradient g_i is computed at the old
x_i, from member i's own mean loss. When the exchange has landed (`finish_step`) the update is

    x_i <- step(sum_j W_ij x_j, g_i)

where W is the topology's mixing matrix at that step and `step(x, g)` is the configured optimizer's
step from the mixed point x with gradient g, its state (momentum, Adam moments) local to the member.
With plain SGD (no momentum, no weight decay) this is D-PSGD's x_i <- sum_j W_ij x_j - lr g_i(x_i).

- `dpsgd`: any configured optimizer, under the rule above.
- `dadam`: the same rule with AdamW as the local step (needs optimizer.name: adamw): member i keeps
  m_i, v_i of its own gradients, and x_i <- x̄_i - lr (m̂_i / (sqrt(v̂_i) + eps) + wd x̄_i) with
  x̄_i = sum_j W_ij x_j. Moments never travel; only parameters are mixed.

The topology is rebuilt from (rank, world size) in every membership epoch (`on_membership`, which
also checks that its W is doubly stochastic) and asked for the step's row at every step, so the
time-varying ones follow the step count. A step commits when its exchanges land (kind
`decentralized`); a failed send or receive raises CommError from `finish_step` and the step is not
taken (the parameters are untouched until the exchange lands). Memory beyond the model and
optimizer: one flat copy of the parameters to send and one receive buffer per peer.

Neither policy is registered yet: the schema refuses a job naming them (core/schema.py `NOT_WIRED`)
until their end-to-end runs under Ray are verified; the in-process tests register them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from algorithms.base import Algorithm, AlgorithmImpl, EpochInfo, StepVote, VoteDraft
from algorithms.topologies import Row, get_topology


def consensus_distance(replicas) -> float:
    """(1/n) sum_i ||x_i - x̄||^2 over the rows x_i of an (n, d) array or tensor (x̄ their mean)."""
    x = np.asarray(replicas, dtype=np.float64)
    return float(((x - x.mean(axis=0)) ** 2).sum(axis=1).mean())


@dataclass
class _Exchange:
    """One step's exchange in flight: this member's row of W, what it sent and what it receives."""

    row: Row
    mine: torch.Tensor
    received: dict[int, torch.Tensor]
    handles: list


class GossipImpl(AlgorithmImpl):
    trace: Optional[list[tuple[str, int]]] = None
    """When a list, the exchange appends ("launch", step) and ("land", step): for tests."""

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.topology = get_topology(self.config.topology.kind, **self.config.topology.params())
        self.exchange: Optional[_Exchange] = None
        self.mixed: Optional[torch.Tensor] = None
        """sum_j W_ij x_j of the step whose exchange landed, until `apply_update` takes it."""

    def on_membership(self, comm, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        self.topology.check(epoch.world_size)
        self.exchange = self.mixed = None

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(self.dtype) for p in self.params])

    def before_forward(self, step: int) -> None:
        if self.comm is None or self.epoch.world_size == 1:
            return
        rank, world = self.epoch.rank, self.epoch.world_size
        mine = self._flat()
        row = self.topology.peers(rank, world, step)
        received = {peer: torch.empty_like(mine) for peer, _ in row if peer != rank}
        handles = [self.comm.send(mine, dst) for dst in self.topology.sends_to(rank, world, step)]
        handles += [self.comm.recv(buf, src) for src, buf in received.items()]
        self.exchange = _Exchange(row, mine, received, handles)
        if self.trace is not None:
            self.trace.append(("launch", step))

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        exchange, self.exchange = self.exchange, None
        if exchange is None:
            return StepVote.local(draft)
        for handle in exchange.handles:
            handle.wait()
        rank = self.epoch.rank
        self.mixed = sum(weight * (exchange.mine if peer == rank else exchange.received[peer])
                         for peer, weight in exchange.row)
        if self.trace is not None:
            self.trace.append(("land", step))
        return StepVote(True, draft.loss, draft.samples, draft.newer_plan, communicated=True)

    def apply_update(self, step: int, lr: float) -> None:
        """The optimizer's step from the mixed parameters, with the gradient taken at the old ones."""
        mixed, self.mixed = self.mixed, None
        if mixed is not None:
            with torch.no_grad():
                for p, chunk in zip(self.params, mixed.split([p.numel() for p in self.params])):
                    p.copy_(chunk.view_as(p))
        super().apply_update(step, lr)

    def discard(self, step: int) -> None:
        self.exchange = self.mixed = None

    def on_epoch_end(self, reason: str) -> None:
        self.exchange = self.mixed = None  # its buffers are abandoned with the group


class DPSGD(Algorithm):
    """D-PSGD: mix parameters with the topology's peers, overlapped with the local gradient."""

    name = "dpsgd"
    kind = "decentralized"
    impl = GossipImpl


class DAdam(DPSGD):
    """Decentralized Adam: `dpsgd` with AdamW moments kept locally."""

    name = "dadam"
