"""The communicator's base: the handle of a pending operation, the state every group shares (abort
flag, pending handles, byte counter, modelled latency), the group-less epoch, and the operations gloo
and NCCL run alike on torch's c10d backend API.

Every operation is asynchronous and returns a `WorkHandle` whose `wait(timeout)` honours three things
at once: the operation finishing, one timeout (`comm.timeout_s`) and an epoch abort raised from the
control thread when the coordinator learns of a death.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from core.comm_api import CommAborted, CommError, CommTimeout, Communicator, GroupSpec

_BACKEND_TIMEOUT = re.compile(r"timed out|timing out|NCCL timeout", re.IGNORECASE)
"""What a backend's own timeout says (gloo: "Timed out waiting 4000ms for recv operation to complete";
NCCL's non-blocking communicator: "NCCL timeout in: .../NCCLUtils.cpp:197"; its watchdog: "... ran
for 3000 milliseconds before timing out")."""


def backend_error(name: str, err: BaseException, backend: str = "") -> CommError:
    """A backend operation's error as group `name`'s CommError: a CommTimeout where the backend's own
    deadline (the group's timeout, counted from the launch) passed, which can come before a wait's
    (counted from the call to `wait`). `backend` prefixes the text ("NCCL")."""
    text = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    prefix = f"{backend}: " if backend else ""
    return (CommTimeout if _BACKEND_TIMEOUT.search(text) else CommError)(f"group {name}: {prefix}{text}")


class Work(Protocol):
    """The part of a c10d `Work` a `WorkHandle` uses (gloo's own works, and the adapters `_WaitedWork`
    and `_CudaWork` for works without a usable future)."""

    def get_future(self) -> torch.futures.Future[Any]: ...
    def is_completed(self) -> bool: ...
    def wait(self) -> object: ...


class WorkHandle:
    """A pending operation (core/comm_api.py `Handle`). `wait()` raises CommError / CommAborted / CommTimeout."""

    __slots__ = ("_work", "_comm", "_done", "_keep", "_launched", "latency_s")

    def __init__(self, work: Work, comm: BaseCommunicator, keep: Sequence[torch.Tensor]) -> None:
        self._work = work
        self._comm = comm
        self._keep = keep  # the buffers stay alive while the backend may write into them
        self._launched = time.monotonic()
        self.latency_s = comm.latency_s
        """Modelled latency of this operation (`BaseCommunicator.op_latency`): its wait returns no sooner."""
        self._done = threading.Event()
        comm._track(self)
        work.get_future().add_done_callback(lambda _fut: self._done.set())

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        limit = self._comm.timeout_s if timeout is None else timeout
        finished = self._done.wait(limit)
        if self._comm.aborted:
            kind = CommTimeout if self._comm.timed_out else CommAborted
            raise kind(f"group {self._comm.name}: membership epoch aborted ({self._comm.abort_reason})")
        if not finished:
            self._comm.mark_failed()
            raise CommTimeout(f"group {self._comm.name}: operation did not finish within {limit:.1f}s")
        self._comm._untrack(self)
        try:
            self._work.wait()
        except Exception as err:  # noqa: BLE001 - any backend error is a failed collective
            self._comm.mark_failed()
            raise backend_error(self._comm.name, err) from None
        if self.latency_s > 0:  # modelled latency: done no sooner than this after launch
            time.sleep(max(0.0, self._launched + self.latency_s - time.monotonic()))


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class BaseCommunicator:
    """State shared by both backends: abort flag, pending handles, byte counter."""

    device = torch.device("cpu")
    """Where this group's own small tensors (votes, agreements) live: CPU for gloo, the GPU for NCCL."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.timeout_s = spec.timeout_s
        self.bytes_sent = 0
        self.latency_s = 0.0
        """A modelled network latency (`faults.comm_latency_s`): each operation's wait returns no
        sooner than this after its launch (overlapped operations overlap their latencies)."""
        self.link_latency_s: list[list[float]] | None = None
        """The lab's modelled one-way latency between ranks (`network:`; orchestrator/lab.py), added per
        operation by its sequential message rounds (`op_latency`)."""
        self.aborted = False
        self.timed_out = False
        self.failed = False
        self.abort_reason = ""
        self.error: CommError | None = None
        """The first failed operation's error (for callers that see the failure second-hand, as a
        RuntimeError out of torch's reducer inside backward)."""
        self._pending: set[WorkHandle] = set()
        self._lock = threading.Lock()

    @property
    def models_latency(self) -> bool:
        return self.latency_s > 0 or bool(self.link_latency_s and any(any(row) for row in self.link_latency_s))

    def op_latency(self, op: str, peer: int | None = None) -> float:
        """The modelled latency of one operation: `latency_s`, plus, in the lab, its sequential message
        rounds times the slowest link among the members (a ring all-reduce 2(n-1), an all-gather, a
        broadcast or a reduce-scatter n-1, an all-to-all 1; each round waits for its slowest hop), or the link to `peer`."""
        matrix = self.link_latency_s
        if not matrix:
            return self.latency_s
        if peer is not None:
            return self.latency_s + matrix[self.rank][peer]
        n = self.world_size
        rounds = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "broadcast": n - 1, "all_to_all": 1,
                  "barrier": 2 * (n - 1), "reduce_scatter": n - 1}[op]
        return self.latency_s + rounds * max(max(row) for row in matrix)

    def _timed(self, handle: WorkHandle, op: str, peer: int | None = None) -> WorkHandle:
        if self.link_latency_s:
            handle.latency_s = self.op_latency(op, peer)
        return handle

    def _track(self, handle: WorkHandle) -> None:
        with self._lock:
            self._pending.add(handle)
        # an abort that looked at the pending handles before this one was added has set the flag first:
        # release this one too (its launch passed the check as the abort landed)
        if self.aborted:
            handle._done.set()

    def _untrack(self, handle: WorkHandle) -> None:
        with self._lock:
            self._pending.discard(handle)

    def mark_failed(self) -> None:
        self.failed = True

    def abort(self, reason: str = "aborted by coordinator") -> None:
        """Fail every pending and future wait at once (called from a control thread)."""
        self.aborted = True
        self.failed = True
        self.abort_reason = reason
        with self._lock:
            pending = list(self._pending)
        for handle in pending:
            handle._done.set()

    def failure(self) -> CommError:
        """The error a failed or aborted operation of this group raises."""
        if self.aborted:
            kind = CommTimeout if self.timed_out else CommAborted
            return kind(f"group {self.name}: membership epoch aborted ({self.abort_reason})")
        return self.error or CommError(f"group {self.name}: a collective failed")

    def process_group(self) -> dist.ProcessGroup | None:
        """This group as a torch `ProcessGroup`, for torch's C++ gradient reducer; None where the
        group has none (no group: the server kinds)."""
        return None

    def ranked_group(self) -> dist.ProcessGroup | None:
        """This group as a torch `ProcessGroup` of its own rank and size, for torch code that runs its
        collectives itself (FSDP, actors/training/sharding.py); None where the backend has none. Lent: an
        abort shuts it down as it does the reducer's group."""
        return None

    def subgroup(self, ranks: Sequence[int], tag: str) -> Communicator | None:
        """A group of this group's `ranks` (ranked in that order) for collectives among them alone, or
        None where the backend forms none (callers fall back to point-to-point messages)."""
        return None

    def failed_in_backend(self, err: BaseException) -> CommError:
        """`err`, raised by a backend operation that ran outside a `Handle` (torch's reducer inside
        backward), as this group's CommError; the group is failed from now on."""
        self.failed = True
        if self.error is None and not self.aborted:
            self.error = backend_error(self.name, err)
        return self.failure()

    def settled(self) -> None:
        """The group's first step has committed: work that would slow a re-form is done now, off its
        path (gloo: its pairs are found, and the next group's device and store connection made).
        Nothing here."""

    def at_launch(self) -> None:
        """A step's buckets go out on torch's reducer: nothing to do (a fault wrapper fires here)."""

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        n = self.world_size
        return int(2 * (n - 1) * tensor.numel() * tensor.element_size() // max(n, 1))

    # The operations of `core.comm_api.Communicator`, declared here so that code holding any group can
    # call them; gloo and NCCL implement each (`TorchBackendCommunicator` and its subclasses). A
    # membership epoch without a group (`NoGroup`) has none of them.
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no all_reduce")

    def broadcast(self, tensor: torch.Tensor, src: int) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no broadcast")

    def barrier(self) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no barrier")

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no all_gather")

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all")

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str = "sum") -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no reduce_scatter")

    def send(self, tensor: torch.Tensor, dst: int) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no send")

    def recv(self, tensor: torch.Tensor, src: int) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no recv")

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> WorkHandle:
        raise NotImplementedError(f"{type(self).__name__} has no exchange")

    def close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no close")


class NoGroup(BaseCommunicator):
    """A membership epoch without a group: the members of a server kind talk only to the parameter
    server, so they form nothing (a member's death never stalls the others) and only keep the epoch's
    name, its abort flag and a zero byte count."""

    def close(self) -> None:
        pass


class TorchBackendCommunicator(BaseCommunicator):
    """The operations gloo and NCCL run alike: torch's c10d backend API on the group's `_pg`, with the
    bytes each sends counted the same way. How a launched work becomes a `Handle` is the backend's
    (`_submit`, and `_submit_futureless` for send, recv and reduce-scatter)."""

    _pg: Any

    def _submit(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> WorkHandle:
        raise NotImplementedError

    def _submit_futureless(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> WorkHandle:
        return self._submit(launch, keep)

    def _submit_exchange(self, launch: Callable[[], list[Any]], keep: Sequence[torch.Tensor]) -> WorkHandle:
        """One handle for the point-to-point works `launch` issues (each backend's own: NCCL groups them)."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> WorkHandle:
        handle = self._timed(self._submit(lambda: self._pg.allreduce([tensor], _opts(op)), (tensor,)), "all_reduce")
        self.bytes_sent += self._ring_bytes(tensor)
        return handle

    def broadcast(self, tensor: torch.Tensor, src: int) -> WorkHandle:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        handle = self._timed(self._submit(lambda: self._pg.broadcast([tensor], opts), (tensor,)), "broadcast")
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        return handle

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> WorkHandle:
        handle = self._timed(self._submit(lambda: self._pg.allgather([outputs], [tensor]), (tensor, *outputs)),
                             "all_gather")
        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        return handle

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> WorkHandle:
        """Chunk i of `tensor` (split evenly by world size) goes to rank i; chunk j of `output` comes from rank j."""
        handle = self._timed(self._submit(lambda: self._pg.alltoall_base(output, tensor, [], [], dist.AllToAllOptions()),
                                          (tensor, output)), "all_to_all")
        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1) // max(self.world_size, 1)
        return handle

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: str = "sum") -> WorkHandle:
        """`output` of rank r: the reduction over the ranks of their `inputs[r]` (one input per rank, each
        the shape of `output`)."""
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _OPS[op]  # type: ignore[assignment]  # as in `_opts`
        handle = self._timed(self._submit_futureless(lambda: self._pg.reduce_scatter([output], [list(inputs)], opts),
                                                     (output, *inputs)), "reduce_scatter")
        self.bytes_sent += output.numel() * output.element_size() * (self.world_size - 1)
        return handle

    def send(self, tensor: torch.Tensor, dst: int) -> WorkHandle:
        handle = self._timed(self._submit_futureless(lambda: self._pg.send([tensor], dst, 0), (tensor,)), "send", dst)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return handle

    def recv(self, tensor: torch.Tensor, src: int) -> WorkHandle:
        return self._timed(self._submit_futureless(lambda: self._pg.recv([tensor], src, 0), (tensor,)), "recv", src)

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> WorkHandle:
        def launch() -> list[Any]:
            return ([self._pg.send([tensor], dst, 0) for tensor, dst in sends]
                    + [self._pg.recv([tensor], src, 0) for tensor, src in recvs])
        keep = tuple(tensor for tensor, _ in (*sends, *recvs))
        handle = self._submit_exchange(launch, keep)
        peers = {peer for _, peer in (*sends, *recvs)}
        if peers and self.link_latency_s:  # the lab: done once its slowest link has delivered
            handle.latency_s = max(self.op_latency("send", peer) for peer in peers)
        self.bytes_sent += sum(tensor.numel() * tensor.element_size() for tensor, _ in sends)
        return handle


def _opts(op: str) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[op]  # type: ignore[assignment]  # torch's stub types ReduceOp.SUM as RedOpType; pybind converts it
    return opts
