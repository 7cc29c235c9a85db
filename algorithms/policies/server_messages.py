"""What a member and a server policy's server exchange: the fence on every call, a pull's answer, a
push and its result, and the record of an applied version. Plain frozen dataclasses (and literals for
the statuses); the rules that produce them are in algorithms/policies/server.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from algorithms.rules.leases import Ticket

PullStatus = Literal["ok", "wait", "finished", "not_member", "fenced_worker"]
PushStatus = Literal["applied", "staged", "dropped", "duplicate", "stale", "finished",
                     "not_member", "fenced_worker", "fenced_server"]
NOT_APPLIED = ("not_member", "fenced_worker", "fenced_server", "duplicate", "stale", "dropped", "finished")


@dataclass(frozen=True)
class Fence:
    """Who sends a pull or a push, and to which server incarnation."""

    membership_epoch: int
    slot: str
    worker_incarnation: int
    server_incarnation: int


@dataclass(frozen=True)
class Pull:
    status: PullStatus
    ticket: Ticket | None = None
    version: int = 0
    """The version of the parameters the puller gets (push it back as `pulled_version`)."""
    clock: int = 0
    server_incarnation: int = 0


@dataclass(frozen=True)
class Push:
    fence: Fence
    lease_ids: tuple[int, ...]
    pulled_version: int
    grad: torch.Tensor
    """Flat float32 gradient of the loss weighted by n_i / B. Held (not copied) until its clock is
    applied: the sender must not reuse the buffer."""
    loss: float = 0.0
    """The member's loss, weighted the same way."""
    buffers: torch.Tensor | None = None
    """The member's model buffers (BatchNorm's running statistics, ...) after this step, flat, as float64
    (integer buffers exactly); None when the model has none."""


@dataclass(frozen=True)
class Update:
    """One applied version: what history and `record_samples` need."""

    version: int
    lr: float
    loss: float
    """The mean loss over the update's samples."""
    samples: int
    tickets: tuple[Ticket, ...]
    staleness: tuple[int, ...]
    barrier: int | None = None
    """elastic_bsp: the index of the barrier this update is (None: a single push applied as in ASP)."""
    grad_norm: float | None = None
    """The norm of the gradient it applied, before clipping (with `optimizer.clip_grad_norm`)."""


@dataclass(frozen=True)
class PushResult:
    status: PushStatus
    version: int
    updates: tuple[Update, ...] = ()
    """Versions this push completed (none while staged)."""

