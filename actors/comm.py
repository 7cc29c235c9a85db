"""Membership-epoch-scoped communicator: one interface over gloo (CPU) and NCCL (GPU).

Every operation is asynchronous and returns a `Handle` whose `wait(timeout)` honours three
things at once: the operation finishing, one timeout (`comm.timeout_s`) and an epoch abort
raised from the control thread when the coordinator learns of a death. A group belongs to one
membership epoch and is never reused; its name is `<job>/<run id>/c<incarnation>/e<epoch>`.
Buffers handed to an aborted group are abandoned (the stuck operation may still write into
them until its own timeout), and failed groups are closed in the background.

The CPU path builds `ProcessGroupGloo` directly on a `PrefixStore` over the coordinator's
`TCPStore`, with its device bound to the node's address. ray.util.collective's gloo backend is
not used: it creates torch's default process group once per process, blocks, ignores the
timeout and takes a process-wide lock while a group forms. The GPU path drives a cupy
`NcclCommunicator` directly on a side stream (see `NcclCommunicator` below for why).
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from core.schema import OrchestratorError


class CommError(OrchestratorError):
    """A collective failed (peer gone, connection reset, mismatched group)."""


class CommAborted(CommError):
    """The membership epoch was aborted while the operation was pending."""


class CommTimeout(CommError):
    """The operation did not finish within comm.timeout_s."""


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


class Handle:
    """A pending operation. `wait()` raises CommError / CommAborted / CommTimeout."""

    __slots__ = ("_work", "_comm", "_done", "_keep", "_finish")

    def __init__(self, work, comm: "BaseCommunicator", keep: Sequence[torch.Tensor], finish: Optional[Callable[[], None]] = None) -> None:
        self._work = work
        self._comm = comm
        self._keep = keep  # the buffers stay alive while the backend may write into them
        self._finish = finish
        self._done = threading.Event()
        comm._track(self)
        work.get_future().add_done_callback(lambda _fut: self._done.set())

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        limit = self._comm.timeout_s if timeout is None else timeout
        finished = self._done.wait(limit)
        if self._comm.aborted:
            raise CommAborted(f"group {self._comm.name}: membership epoch aborted ({self._comm.abort_reason})")
        if not finished:
            self._comm.mark_failed()
            raise CommTimeout(f"group {self._comm.name}: operation did not finish within {limit:.1f}s")
        self._comm._untrack(self)
        try:
            self._work.wait()
        except Exception as err:  # noqa: BLE001 - any backend error is a failed collective
            self._comm.mark_failed()
            raise CommError(f"group {self._comm.name}: {str(err).splitlines()[0][:300]}") from None
        if self._finish is not None:
            self._finish()


class Communicator(Protocol):
    """What algorithms see (algorithms/ never imports Ray or a backend)."""

    rank: int
    world_size: int
    bytes_sent: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle: ...
    def barrier(self) -> Handle: ...
    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle: ...
    def send(self, tensor: torch.Tensor, dst: int) -> Handle: ...
    def recv(self, tensor: torch.Tensor, src: int) -> Handle: ...


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class BaseCommunicator:
    """State shared by both backends: abort flag, pending handles, byte counter."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.timeout_s = spec.timeout_s
        self.bytes_sent = 0
        self.aborted = False
        self.failed = False
        self.abort_reason = ""
        self._pending: set[Handle] = set()
        self._lock = threading.Lock()

    def _track(self, handle: Handle) -> None:
        with self._lock:
            self._pending.add(handle)

    def _untrack(self, handle: Handle) -> None:
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

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        n = self.world_size
        return int(2 * (n - 1) * tensor.numel() * tensor.element_size() // max(n, 1))


class GlooCommunicator(BaseCommunicator):
    """torch ProcessGroupGloo on a PrefixStore of the group name over the coordinator's store."""

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:
        super().__init__(spec)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=spec.timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.node_ip)]
        prefix = dist.PrefixStore(spec.name + "/", store)
        try:
            self._pg = dist.ProcessGroupGloo(prefix, spec.rank, spec.world_size, opts)
        except Exception as err:  # noqa: BLE001
            raise CommError(f"group {spec.name}: could not form: {str(err).splitlines()[0][:300]}") from None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        self._check()
        work = self._pg.allreduce([tensor], dist.AllreduceOptions() if op == "sum" else _opts(op))
        self.bytes_sent += self._ring_bytes(tensor)
        return Handle(work, self, (tensor,))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        self._check()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        work = self._pg.broadcast([tensor], opts)
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        return Handle(work, self, (tensor,))

    def barrier(self) -> Handle:
        self._check()
        return Handle(self._pg.barrier(), self, ())

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        self._check()
        work = self._pg.allgather([outputs], [tensor])
        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        return Handle(work, self, (tensor, *outputs))

    def send(self, tensor: torch.Tensor, dst: int) -> Handle:
        self._check()
        work = self._pg.send([tensor], dst, 0)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return Handle(work, self, (tensor,))

    def recv(self, tensor: torch.Tensor, src: int) -> Handle:
        self._check()
        return Handle(self._pg.recv([tensor], src, 0), self, (tensor,))

    def _check(self) -> None:
        if self.aborted:
            raise CommAborted(f"group {self.name}: membership epoch aborted ({self.abort_reason})")

    def close(self) -> None:
        """Release the group in the background once its stuck operations have timed out."""
        pg, self._pg = self._pg, None
        with self._lock:
            works = [h._work for h in self._pending]
            self._pending.clear()
        if pg is not None:
            deadline = time.monotonic() + self.timeout_s + 5.0
            threading.Thread(target=_release, args=(pg, works, deadline), name=f"close {self.name}", daemon=True).start()


def _release(pg, works: list, deadline: float) -> None:
    """Hold the group (and the buffers its works reference) until they finish or time out."""
    while works and time.monotonic() < deadline:
        works = [w for w in works if not w.is_completed()]
        time.sleep(0.1)
    del pg, works


def _opts(op: str) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[op]
    return opts


class NcclCommunicator(BaseCommunicator):
    """NCCL through cupy's `NcclCommunicator`, one per membership epoch, on a side stream.

    ray.util.collective's NCCL group launches synchronously on the current stream and has no
    timeout or abort, which this interface needs; so the communicator is built directly. Rank 0
    publishes the NCCL unique id in the group's store prefix; the others read it. Each
    operation is enqueued on a private stream and followed by a CUDA event; `Handle.wait` polls
    that event against the abort flag and the timeout, and on timeout or abort calls
    `ncclCommAbort` so that the peers' kernels are released too.
    """

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:  # pragma: no cover - needs a GPU
        super().__init__(spec)
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl = cupy, nccl
        prefix = dist.PrefixStore(spec.name + "/", store)
        if spec.rank == 0:
            prefix.set("nccl_uid", bytes(bytearray(b % 256 for b in nccl.get_unique_id())))
        raw = prefix.get("nccl_uid")
        uid = tuple(b if b < 128 else b - 256 for b in raw)
        self._comm = nccl.NcclCommunicator(spec.world_size, uid, spec.rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)

    def _launch(self, fn: Callable[[int], None], keep: Sequence[torch.Tensor]) -> Handle:  # pragma: no cover
        if self.aborted:
            raise CommAborted(f"group {self.name}: membership epoch aborted ({self.abort_reason})")
        torch.cuda.current_stream().synchronize()  # inputs are ready before NCCL reads them
        fn(self._stream.ptr)
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self._stream)
        return Handle(_CudaEventWork(event, self), self, keep)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:  # pragma: no cover
        nccl_op = {"sum": self._nccl.NCCL_SUM, "max": self._nccl.NCCL_MAX, "min": self._nccl.NCCL_MIN}[op]
        self.bytes_sent += self._ring_bytes(tensor)
        return self._launch(lambda s: self._comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _nccl_dtype(self._nccl, tensor), nccl_op, s), (tensor,))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:  # pragma: no cover
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        return self._launch(lambda s: self._comm.bcast(tensor.data_ptr(), tensor.numel(), _nccl_dtype(self._nccl, tensor), src, s), (tensor,))

    def barrier(self) -> Handle:  # pragma: no cover
        token = torch.zeros(1, device="cuda")
        return self.all_reduce(token)

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle:  # pragma: no cover
        flat = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)

        def scatter_back() -> None:
            for i, out in enumerate(outputs):
                out.copy_(flat[i * tensor.numel():(i + 1) * tensor.numel()].view_as(out))

        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        handle = self._launch(lambda s: self._comm.allGather(tensor.data_ptr(), flat.data_ptr(), tensor.numel(), _nccl_dtype(self._nccl, tensor), s), (tensor, flat, *outputs))
        handle._finish = scatter_back
        return handle

    def send(self, tensor: torch.Tensor, dst: int) -> Handle:  # pragma: no cover
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self._launch(lambda s: self._comm.send(tensor.data_ptr(), tensor.numel(), _nccl_dtype(self._nccl, tensor), dst, s), (tensor,))

    def recv(self, tensor: torch.Tensor, src: int) -> Handle:  # pragma: no cover
        return self._launch(lambda s: self._comm.recv(tensor.data_ptr(), tensor.numel(), _nccl_dtype(self._nccl, tensor), src, s), (tensor,))

    def abort(self, reason: str = "aborted by coordinator") -> None:  # pragma: no cover
        super().abort(reason)
        self._comm.abort()

    def close(self) -> None:  # pragma: no cover
        comm, self._comm = self._comm, None
        threading.Thread(target=comm.abort if self.failed else comm.destroy, daemon=True).start()


class _CudaEventWork:  # pragma: no cover - needs a GPU
    """Adapts a CUDA event to the subset of c10d.Work that Handle uses."""

    def __init__(self, event, comm: NcclCommunicator) -> None:
        self._event, self._comm = event, comm
        self._future = torch.futures.Future()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        deadline = time.monotonic() + self._comm.timeout_s
        while not self._event.done and not self._comm.aborted and time.monotonic() < deadline:
            time.sleep(0.0002)
        if not self._event.done and not self._comm.aborted:
            self._comm.abort("NCCL operation timed out")
        self._future.set_result(None)

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        if not self._event.done:
            raise CommError(f"group {self._comm.name}: NCCL operation aborted")
        self._comm._comm.check_async_error()


def _nccl_dtype(nccl, tensor: torch.Tensor) -> int:  # pragma: no cover
    return {torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16, torch.float64: nccl.NCCL_FLOAT64,
            torch.int64: nccl.NCCL_INT64, torch.int32: nccl.NCCL_INT32, torch.uint8: nccl.NCCL_UINT8,
            torch.bfloat16: getattr(nccl, "NCCL_BFLOAT16", nccl.NCCL_FLOAT16)}[tensor.dtype]


# --------------------------------------------------------------------------- store and factory
_client_stores: dict[tuple[str, int], dist.Store] = {}
_store_lock = threading.Lock()


def client_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """One client connection per (host, port), shared by all of a process's groups."""
    with _store_lock:
        key = (host, port)
        if key not in _client_stores:
            _client_stores[key] = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
        return _client_stores[key]


def make_communicator(spec: GroupSpec) -> BaseCommunicator:
    """Form the group of one membership epoch (blocks until every member arrives or timeout)."""
    try:
        store = client_store(spec.store_host, spec.store_port, spec.timeout_s)
    except Exception as err:  # noqa: BLE001
        raise CommError(f"store {spec.store_host}:{spec.store_port} unreachable: {str(err).splitlines()[0][:200]}") from None
    if spec.backend == "nccl":
        return NcclCommunicator(spec, store)
    return GlooCommunicator(spec, store)


def serve_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int, socket.socket]:
    """Start the TCPStore server on a socket bound to `host` only (not all interfaces).

    The caller keeps the returned socket for as long as the store serves.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    return store, port, sock
