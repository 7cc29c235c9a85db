"""What `shadow` talks to, as Protocols: its background group, the job's lease dispenser and the central copy.

A member of the background kind reaches three things outside its process, and the policy
(algorithms/policies/shadow.py) and its background synchronizer (algorithms/policies/shadow_sync.py) see each one only
through the contract here: the membership epoch's background group (a communicator of its own, formed
by the replica: `GroupFactory`), the lease dispenser on the parameter server (`DispenserClient`,
actors/server/parameter_server.py), and EASGD's central copy (`CentralCopy`, on that server too). The real
objects live in actors/; algorithms/ never imports them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from algorithms.policies.base import EpochInfo
from algorithms.policies.server_messages import Fence
from algorithms.rules.leases import Ticket


class Pending(Protocol):
    """A launched collective (actors/transport/comm.py `Handle`)."""

    def wait(self, timeout: float | None = None) -> None:
        """Return once it finished; raise when it failed or took longer than `timeout` s."""


class RoundGroup(Protocol):
    """What a background round needs of its epoch's group: a sum all-reduce and a count of bytes sent."""

    @property
    def world_size(self) -> int: ...
    @property
    def bytes_sent(self) -> int: ...
    def all_reduce(self, tensor: torch.Tensor) -> Pending: ...


class BackgroundGroup(RoundGroup, Protocol):
    """A member's background group of one membership epoch (its own gloo group, `<group>/bg`): what
    entering the epoch and leaving it need besides the rounds."""

    @property
    def rank(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> Pending: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


GroupFactory = Callable[[EpochInfo], BackgroundGroup | None]
"""Forms this member's background group of a membership epoch (its own gloo group, `<group>/bg`);
returns None when a newer membership superseded it, raises when it could not form."""


class CentralCopy(Protocol):
    """The EASGD central copy (on the parameter server): one atomic elastic exchange per call."""

    def elastic(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """Apply c <- c + alpha (x - c) and return d = alpha (x - c) (computed from the old c)."""


class DispenserClient(Protocol):
    """A member's way to the job's lease dispenser and central copy (actors/server/parameter_server.py)."""

    def lease_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple[Ticket, ...]]:
        """`count` tickets of `size` samples; (refusal, ()) when refused or unreachable ("wait")."""

    def applied(self, fence: Fence, keys: list[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> None:
        """These tickets (first lease ids) were applied (sent without waiting). `final`: this member's
        run ended, every ticket up to clock `upto` applied; returns once the dispenser has it.
        `finished`: it reached its stop (its replica goes into the final model)."""

    def elastic(self, fence: Fence, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """EASGD's exchange with the central copy; raises when refused or unreachable."""
