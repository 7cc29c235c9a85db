"""The communication contract: what a membership epoch's group is (`GroupSpec`), what one of its
operations returns (`Handle`), what a policy sees of it (`Communicator`), and the errors it raises
(`CommError` and its subclasses).

The transport (actors/transport/, through actors/transport/comm.py) implements it over gloo and NCCL; algorithms/
and the tests' fakes program against it. Torch-free at import: torch's types appear only in annotations.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from core.schema import OrchestratorError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class CommError(OrchestratorError):
    """A collective failed (peer gone, connection reset, mismatched group)."""


class CommAborted(CommError):
    """The membership epoch was aborted while the operation was pending."""


class CommTimeout(CommError):
    """The operation did not finish within comm.timeout_s."""


class ForgedRendezvous(CommError):
    """A value in the group's store was not written by a member of this job (no valid signature)."""


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one membership epoch's group."""

    store_host: str
    store_port: int
    name: str
    rank: int
    world_size: int
    timeout_s: float
    backend: str = "gloo"
    node_ip: str = "127.0.0.1"
    secret: bytes = field(default=b"", repr=False)
    """The job's rendezvous key: with one, the group's store values are signed and checked (`SignedStore`)."""
    reduce_bytes: int = 0
    """The largest tensor its members all-reduce, where the caller knows it (0: not known): a group on one
    node reserves shared memory for tensors of that size (actors/transport/shm.py); larger ones go through gloo."""
    formation_timeout_s: float | None = None
    """How long the group may take to form (the store's rendezvous, the connections, NCCL's communicator);
    None: `timeout_s`, which then bounds each operation only."""

    @property
    def forming_s(self) -> float:
        return self.timeout_s if self.formation_timeout_s is None else self.formation_timeout_s


class Handle(Protocol):
    """A pending operation. `wait()` raises CommError / CommAborted / CommTimeout."""

    def is_completed(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> None: ...


class Communicator(Protocol):
    """What algorithms see (algorithms/ never imports Ray or a backend)."""

    rank: int
    world_size: int
    bytes_sent: int
    aborted: bool
    """The membership epoch was aborted: every pending and later wait fails."""
    failed: bool
    """An operation of this group failed (or it was aborted): it is never used again."""
    latency_s: float
    """A modelled network latency (`faults.comm_latency_s`): each operation completes no sooner."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle: ...
    def barrier(self) -> Handle: ...
    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle: ...
    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Handle: ...
    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str = "sum") -> Handle: ...
    def send(self, tensor: torch.Tensor, dst: int) -> Handle: ...
    def recv(self, tensor: torch.Tensor, src: int) -> Handle: ...
    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> Handle:
        """Every send (tensor, destination rank) and receive (buffer, source rank) of one exchange, launched
        as one operation that completes when all of them have: on NCCL one group of point-to-point calls, so
        that a ring of them cannot deadlock on the communicator's one stream."""
        ...
    def process_group(self) -> dist.ProcessGroup | None: ...
    def ranked_group(self) -> dist.ProcessGroup | None: ...
    def subgroup(self, ranks: Sequence[int], tag: str) -> Communicator | None: ...
    def failed_in_backend(self, err: BaseException) -> CommError: ...
    def at_launch(self) -> None:
        """A step's buckets go out on the backend's own reducer (torch's, in C++, past this interface):
        nothing for a group; the fault-injecting wrapper (actors/faults.py `FaultyComm`) fires an
        `allreduce` kill here."""
