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
timeout and takes a process-wide lock while a group forms. The GPU path builds torch's
`ProcessGroupNCCL` the same way, with a poller for its timeout and abort (see `NcclCommunicator`
below for why torch's and not cupy's). Either group is also reachable through `ray.util.collective`
(actors/collective.py).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import itertools
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from actors.store import GROUP_SUFFIXES, EpochKeys, group_keys, serve_store  # noqa: F401 - re-exported
from core.schema import OrchestratorError

log = logging.getLogger(__name__)


class CommError(OrchestratorError):
    """A collective failed (peer gone, connection reset, mismatched group)."""


class CommAborted(CommError):
    """The membership epoch was aborted while the operation was pending."""


class CommTimeout(CommError):
    """The operation did not finish within comm.timeout_s."""


_BACKEND_TIMEOUT = re.compile(r"timed out|timing out|NCCL timeout", re.IGNORECASE)
"""What a backend's own timeout says (gloo: "Timed out waiting 4000ms for recv operation to complete";
NCCL's non-blocking communicator: "NCCL timeout in: .../NCCLUtils.cpp:197"; its watchdog: "... ran
for 3000 milliseconds before timing out")."""


def _backend_error(name: str, err: BaseException, backend: str = "") -> CommError:
    """A backend operation's error as group `name`'s CommError: a CommTimeout where the backend's own
    deadline (the group's timeout, counted from the launch) passed, which can come before a wait's
    (counted from the call to `wait`). `backend` prefixes the text ("NCCL")."""
    text = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
    prefix = f"{backend}: " if backend else ""
    return (CommTimeout if _BACKEND_TIMEOUT.search(text) else CommError)(f"group {name}: {prefix}{text}")


class ForgedRendezvous(CommError):
    """A value in the group's store was not written by a member of this job (no valid signature)."""


class SignedStore(dist.Store):
    """A store whose values carry an HMAC-SHA256 over (key, value) under the job's secret, checked on
    every read: the coordinator's TCPStore takes any client that reaches its port, so anything on the
    network could otherwise rewrite the rendezvous (gloo addresses, the NCCL unique id, the listening
    addresses the abort shuts connections to) and inject or read gradients and state. The secret
    travels only over Ray (token-authenticated). Counters (`add`) are not signed: a forged one can
    only stall a formation, which then times out; no value read from one is trusted as an address."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        self.inner, self._secret = inner, secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        mac, data = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(mac, self._mac(key, data)):
            raise ForgedRendezvous(f"the rendezvous value for {key!r} is not signed with this job's key: written by "
                                   f"something outside the job; refused")
        return data

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout=None) -> None:
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self.inner.set_timeout(timeout)


def group_store(spec: GroupSpec, store: dist.Store) -> dist.Store:
    """The group's own view of the coordinator's store: its name's prefix, signed when the job has a key."""
    prefix = dist.PrefixStore(spec.name + "/", store)
    return SignedStore(prefix, spec.secret) if spec.secret else prefix


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


class Handle:
    """A pending operation. `wait()` raises CommError / CommAborted / CommTimeout."""

    __slots__ = ("_work", "_comm", "_done", "_keep", "_launched", "latency_s")

    def __init__(self, work, comm: BaseCommunicator, keep: Sequence[torch.Tensor]) -> None:
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
            raise _backend_error(self._comm.name, err) from None
        if self.latency_s > 0:  # modelled latency: done no sooner than this after launch
            time.sleep(max(0.0, self._launched + self.latency_s - time.monotonic()))


class Communicator(Protocol):
    """What algorithms see (algorithms/ never imports Ray or a backend)."""

    rank: int
    world_size: int
    bytes_sent: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle: ...
    def barrier(self) -> Handle: ...
    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle: ...
    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Handle: ...
    def send(self, tensor: torch.Tensor, dst: int) -> Handle: ...
    def recv(self, tensor: torch.Tensor, src: int) -> Handle: ...
    def process_group(self) -> dist.ProcessGroup | None: ...
    def subgroup(self, ranks: Sequence[int], tag: str) -> Communicator | None: ...


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
        self._pending: set[Handle] = set()
        self._lock = threading.Lock()

    @property
    def models_latency(self) -> bool:
        return self.latency_s > 0 or bool(self.link_latency_s and any(any(row) for row in self.link_latency_s))

    def op_latency(self, op: str, peer: int | None = None) -> float:
        """The modelled latency of one operation: `latency_s`, plus, in the lab, its sequential message
        rounds times the slowest link among the members (a ring all-reduce 2(n-1), an all-gather or a
        broadcast n-1, an all-to-all 1; each round waits for its slowest hop), or the link to `peer`."""
        matrix = self.link_latency_s
        if not matrix:
            return self.latency_s
        if peer is not None:
            return self.latency_s + matrix[self.rank][peer]
        n = self.world_size
        rounds = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "broadcast": n - 1, "all_to_all": 1,
                  "barrier": 2 * (n - 1)}[op]
        return self.latency_s + rounds * max(max(row) for row in matrix)

    def _timed(self, handle: Handle, op: str, peer: int | None = None) -> Handle:
        if self.link_latency_s:
            handle.latency_s = self.op_latency(op, peer)
        return handle

    def _track(self, handle: Handle) -> None:
        with self._lock:
            self._pending.add(handle)
        # an abort that looked at the pending handles before this one was added has set the flag first:
        # release this one too (its launch passed the check as the abort landed)
        if self.aborted:
            handle._done.set()

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

    def subgroup(self, ranks: Sequence[int], tag: str) -> BaseCommunicator | None:
        """A group of this group's `ranks` (ranked in that order) for collectives among them alone, or
        None where the backend forms none (callers fall back to point-to-point messages)."""
        return None

    def failed_in_backend(self, err: BaseException) -> CommError:
        """`err`, raised by a backend operation that ran outside a `Handle` (torch's reducer inside
        backward), as this group's CommError; the group is failed from now on."""
        self.failed = True
        if self.error is None and not self.aborted:
            self.error = _backend_error(self.name, err)
        return self.failure()

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        n = self.world_size
        return int(2 * (n - 1) * tensor.numel() * tensor.element_size() // max(n, 1))


class NoGroup(BaseCommunicator):
    """A membership epoch without a group: the members of a server kind talk only to the parameter
    server, so they form nothing (a member's death never stalls the others) and only keep the epoch's
    name, its abort flag and a zero byte count."""

    def close(self) -> None:
        pass


class _TorchBackendCommunicator(BaseCommunicator):
    """The operations gloo and NCCL run alike: torch's c10d backend API on the group's `_pg`, with the
    bytes each sends counted the same way. How a launched work becomes a `Handle` is the backend's
    (`_submit`, and `_submit_p2p` for send and recv)."""

    _pg: Any

    def _submit(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> Handle:
        raise NotImplementedError

    def _submit_p2p(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> Handle:
        return self._submit(launch, keep)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        handle = self._timed(self._submit(lambda: self._pg.allreduce([tensor], _opts(op)), (tensor,)), "all_reduce")
        self.bytes_sent += self._ring_bytes(tensor)
        return handle

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        handle = self._timed(self._submit(lambda: self._pg.broadcast([tensor], opts), (tensor,)), "broadcast")
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        return handle

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        handle = self._timed(self._submit(lambda: self._pg.allgather([outputs], [tensor]), (tensor, *outputs)),
                             "all_gather")
        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1)
        return handle

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> Handle:
        """Chunk i of `tensor` (split evenly by world size) goes to rank i; chunk j of `output` comes from rank j."""
        handle = self._timed(self._submit(lambda: self._pg.alltoall_base(output, tensor, [], [], dist.AllToAllOptions()),
                                          (tensor, output)), "all_to_all")
        self.bytes_sent += tensor.numel() * tensor.element_size() * (self.world_size - 1) // max(self.world_size, 1)
        return handle

    def send(self, tensor: torch.Tensor, dst: int) -> Handle:
        handle = self._timed(self._submit_p2p(lambda: self._pg.send([tensor], dst, 0), (tensor,)), "send", dst)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return handle

    def recv(self, tensor: torch.Tensor, src: int) -> Handle:
        return self._timed(self._submit_p2p(lambda: self._pg.recv([tensor], src, 0), (tensor,)), "recv", src)


class GlooCommunicator(_TorchBackendCommunicator):
    """torch ProcessGroupGloo on a PrefixStore of the group name over the coordinator's store.

    An abort also shuts down the group's own TCP connections (its pairs): an operation blocked in
    C++ on a silent peer, which no Python flag can wake (torch's reducer waiting inside backward),
    then fails at once with "connection closed". Gloo's own `abort()` and `shutdown()` do not release
    it. The pairs are told apart from every other socket of the process by the gloo device's
    listening address, which each member publishes in the group's store: a pair is a connection
    accepted on this member's listening address or made to a peer's. Only a group lent to torch
    (`process_group()`) is shut down so: every other wait is a `Handle`, which the abort releases,
    and tests that run several members of one group in one process would otherwise see a member's
    abort shut down its neighbours' connections to the same peers."""

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:
        super().__init__(spec)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=spec.timeout_s)
        device, self._listen = _device_and_address(spec.node_ip)
        opts._devices = [device]
        prefix = group_store(spec, store)
        self._prefix = prefix
        self._store = store
        self._children: list[GlooCommunicator] = []
        """Subgroups formed from this group (`subgroup`): aborted and released with it."""
        self._torch_pg: dist.ProcessGroup | None = None
        self._peers: set[tuple[str, int]] = set()
        """The peers' gloo listening addresses (a pair is a connection to one of them, or from one)."""
        try:
            prefix.set(f"gloo-listen/{spec.rank}", f"{self._listen[0]} {self._listen[1]}" if self._listen else "")
            self._pg = dist.ProcessGroupGloo(prefix, spec.rank, spec.world_size, opts)
            others = [f"gloo-listen/{r}" for r in range(spec.world_size) if r != spec.rank]
            for value in (prefix.multi_get(others) if others else []):
                host, _, port = value.decode().partition(" ")
                if port:
                    self._peers.add((host, int(port)))
        except Exception as err:  # noqa: BLE001
            raise _formation_error(spec, err, "could not form") from None

    def _abort_pairs(self, reason: str) -> None:
        super().abort(reason)
        with self._lock:
            if self._pg is None or self._torch_pg is None:
                return
            if self._listen is None:
                log.warning("group %s: its gloo listening address is unknown: an operation stuck in C++ waits "
                            "for its timeout (%.0fs)", self.name, self.timeout_s)
                return
            shut = _shut_down_pairs(self._listen, self._peers)
        log.info("group %s aborted (%s): shut down %d gloo connections", self.name, reason, shut)

    def subgroup(self, ranks: Sequence[int], tag: str) -> GlooCommunicator | None:
        """A gloo group of `ranks` (this group's ranks; rank k of the subgroup is `ranks[k]`), formed
        over this group's store under `<name>/<tag>`: every rank in `ranks` calls it at the same point
        (it blocks until all arrive, within the group's timeout); the others get None. It has this
        group's timeout, modelled latencies and key, and is aborted and released with it."""
        ranks = list(ranks)
        if self.rank not in ranks:
            return None
        self._check()
        spec = dataclasses.replace(self.spec, name=f"{self.name}/{tag}", rank=ranks.index(self.rank),
                                   world_size=len(ranks))
        child = self._form_child(spec)
        child.latency_s = self.latency_s
        if self.link_latency_s:
            child.link_latency_s = [[self.link_latency_s[a][b] for b in ranks] for a in ranks]
        with self._lock:
            self._children.append(child)
            aborted = self.aborted
        if aborted:  # an abort that raced the formation
            child.abort(self.abort_reason)
        return child

    def _form_child(self, spec: GroupSpec) -> GlooCommunicator:
        """Form a subgroup in a helper thread (`form_in_thread`); an abort of this group meanwhile
        abandons it at once."""
        child = form_in_thread(spec, lambda: GlooCommunicator(spec, self._store), lambda: self.aborted)
        if child is None:
            raise self.failure()
        return child

    def abort(self, reason: str = "aborted by coordinator") -> None:
        self._abort_pairs(reason)
        with self._lock:
            children = list(self._children)
        for child in children:
            child.abort(reason)

    def _submit(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> Handle:
        self._check()
        return Handle(launch(), self, keep)

    def _submit_p2p(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> Handle:
        """Gloo's send and recv works have no future: a thread waits for each (`_WaitedWork`)."""
        self._check()
        return Handle(_WaitedWork(launch()), self, keep)

    def barrier(self) -> Handle:
        self._check()
        return self._timed(Handle(self._pg.barrier(), self, ()), "barrier")

    def process_group(self) -> dist.ProcessGroup | None:
        """A torch ProcessGroup over this group's gloo backend that calls itself a group of one (rank
        0 of 1): torch's reducer divides every bucket by its group's size before the all-reduce, and
        here the gradients arrive already weighted by each member's share of the global batch, so the
        sum is the mean. The all-reduce itself runs on the gloo backend, across the whole group."""
        if self._torch_pg is None and self._pg is not None:
            self._torch_pg = _group_of_one(self._prefix, "cpu", dist.ProcessGroup.BackendType.GLOO, self._pg)
        return self._torch_pg

    def _check(self) -> None:
        if self.aborted:
            raise CommAborted(f"group {self.name}: membership epoch aborted ({self.abort_reason})")

    def close(self) -> None:
        """Release the group in the background once its stuck operations have timed out.

        Gloo's destructor joins its worker threads, and it runs holding the GIL: dropped while an
        operation is stuck, it would freeze the whole process (the control thread too) until that
        operation's timeout. The operations of a `Handle` are known and waited out first; those torch's
        reducer launched in C++ are not, so a failed group lent to torch is held for its whole timeout."""
        with self._lock:  # not while an abort shuts its pairs down
            pg, self._pg = self._pg, None
            children, self._children = self._children, []
        for child in children:
            child.close()
        lent, self._torch_pg = self._torch_pg, None
        with self._lock:
            works = [h._work for h in self._pending]
            self._pending.clear()
        if pg is not None:
            deadline = time.monotonic() + self.timeout_s + 5.0
            hold = lent is not None and self.failed
            threading.Thread(target=_release, args=((pg, lent), works, deadline, hold), name=f"close {self.name}",
                             daemon=True).start()


class _WaitedWork:
    """Gloo's send and recv works have no future (`Work::getFuture not implemented`) and are complete
    only once waited on: a daemon thread waits (within the group's own timeout) and completes one,
    keeping the outcome for `Handle.wait`."""

    def __init__(self, work) -> None:
        self._work, self._error = work, None
        self._future = torch.futures.Future()
        threading.Thread(target=self._run, name="gloo p2p", daemon=True).start()

    def _run(self) -> None:
        try:
            self._work.wait()
        except Exception as err:  # noqa: BLE001 - re-raised by wait(), where Handle turns it into CommError
            self._error = err
        self._future.set_result(None)

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        if self._error is not None:
            raise self._error


_DEVICE_LOCK = threading.Lock()
"""Serializes gloo device creation in this process, so that the listening socket a creation adds is
known to be its own."""


def _socket_fds() -> dict[int, str]:
    """This process's socket descriptors, each with its socket's identity ("socket:[inode]"): a number
    closed and reused by another socket meanwhile names a different socket."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if link.startswith("socket:"):
            fds[int(name)] = link
    return fds


def _addresses(fd: int) -> tuple[tuple[str, int], tuple[str, int] | None] | None:
    """(local, remote) TCP address of descriptor `fd` (remote None when not connected), read on a
    duplicate of it; None when it is not a TCP socket (any more)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return _addresses_of(sock)
    finally:
        sock.close()  # the duplicate


def _addresses_of(sock: socket.socket) -> tuple[tuple[str, int], tuple[str, int] | None] | None:
    """(local, remote) TCP address of `sock` (remote None when it listens); None when it is not a TCP
    socket or not connected."""
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local = sock.getsockname()[:2]
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return local, None
        try:
            remote = sock.getpeername()[:2]
        except OSError:  # not connected (yet, or any more)
            return None
        return local, remote
    except OSError:
        return None


def _device_and_address(node_ip: str):
    """A gloo device bound to `node_ip`, and the address it listens on (None when it cannot be told
    apart: then an abort cannot shut its pairs down, and a stuck operation waits for its timeout)."""
    with _DEVICE_LOCK:
        before = set(_socket_fds().values()) if sys.platform.startswith("linux") else set()
        device = dist.ProcessGroupGloo.create_device(hostname=node_ip)
        if not sys.platform.startswith("linux"):
            return device, None
        listening = []
        # new sockets by identity, not by number: another thread may close a socket meanwhile and the
        # device's listening socket take its number (a member then could not shut its pairs down)
        for fd in [fd for fd, link in _socket_fds().items() if link not in before]:
            addresses = _addresses(fd)
            if addresses is not None and addresses[1] is None:
                listening.append(addresses[0])
    return device, (listening[0] if len(listening) == 1 else None)


def _shut_down_pairs(listen: tuple[str, int], peers: set[tuple[str, int]]) -> int:
    """Shut down (both directions) every connection of this process accepted on `listen` or made to
    one of `peers`: gloo's pairs of one group. Returns how many.

    Each descriptor is duplicated once, and the socket that duplicate names is the one checked and the
    one shut down: between a check on one duplicate and a shutdown through another, gloo may close a
    pair's descriptor (its peer went away) and another thread of the process (Ray's own connections)
    open a socket under the same number, which would then be shut down in the pair's place."""
    count = 0
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            addresses = _addresses_of(sock)
            if addresses is None or addresses[1] is None:
                continue
            local, remote = addresses
            if local == listen or remote in peers:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
                except OSError:
                    pass
        finally:
            sock.close()  # the duplicate only: gloo's descriptor stays, shut down
    return count


def _group_of_one(store: dist.Store, device: str, kind, backend) -> dist.ProcessGroup:
    """A torch ProcessGroup that calls itself rank 0 of 1 over `backend` (the whole group's), for
    torch's reducer: it divides by its group's size, and the gradients arrive already weighted."""
    group = dist.ProcessGroup(store, 0, 1)
    group._register_backend(torch.device(device), kind, backend)
    group._set_default_backend(kind)
    return group


def _formation_error(spec: GroupSpec, err: BaseException, what: str) -> CommError:
    """A group's formation error as this module's: a rendezvous value the group's signed store refused
    stays `ForgedRendezvous` (with the refusal's own sentence, even where the backend wrapped it), any
    other is a CommError with its first line."""
    text = str(err)
    start = text.find("the rendezvous value")
    if isinstance(err, ForgedRendezvous) or (start >= 0 and "not signed with this job's key" in text):
        return ForgedRendezvous(f"group {spec.name}: {text[max(start, 0):].splitlines()[0][:300]}")
    return CommError(f"group {spec.name}: {what}: {text.splitlines()[0][:300]}")


def _release(pg, works: list, deadline: float, hold: bool = False) -> None:
    """Hold the group (and the buffers its works reference) until they finish or time out; with
    `hold`, until `deadline` whatever the works (operations no one tracks may still be stuck)."""
    while (works or hold) and time.monotonic() < deadline:
        works = [w for w in works if not w.is_completed()]
        time.sleep(0.1)
    del pg, works


def _opts(op: str) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[op]
    return opts


NCCL_WATCHDOG_MARGIN_S = 30.0
"""torch's own NCCL watchdog times an operation out this long after `comm.timeout_s`: the poller of
this module aborts first (and keeps the process); the watchdog is only the backstop."""


def _nccl_environment(timeout_s: float) -> None:
    """What torch's NCCL backend reads at a group's construction, set where the user did not:
    on an error or a timeout, abort the communicator and keep the process (the default tears the
    process down, which would turn a peer's death into this worker's); a non-blocking communicator's
    initialization gives up after the group's timeout."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(max(1.0, timeout_s))))


class NcclCommunicator(_TorchBackendCommunicator):  # pragma: no cover - needs a GPU (tests/gpu)
    """torch's `ProcessGroupNCCL`, one per membership epoch, on a `PrefixStore` of the group's name
    (as gloo's), with this interface's timeout and abort on top.

    Why torch's and not cupy's `NcclCommunicator` (which an earlier version drove): torch's group is a
    torch `ProcessGroup`, so BSP runs on torch's C++ reducer over NCCL exactly as it does over gloo
    (`process_group()`); torch already ships the NCCL it was built with (cupy brings a second NCCL
    library into the process, of whatever version its wheel has); it has `abort()` (ncclCommAbort),
    a non-blocking communicator whose initialization and abort never block the host, and the stream
    ordering with torch's caching allocator done for us (buffers are recorded on its stream). torchft
    builds its fault-tolerant NCCL group the same way.

    Every operation is launched by torch on NCCL's internal stream (which first waits for torch's
    current stream: the inputs are ready, the host never waits), then a completion event is recorded
    on a side stream made to wait for the operation; one poller thread per communicator completes
    each handle when its event fires, or at once on an epoch abort, or at `comm.timeout_s` (then it
    aborts the communicator: a timeout). A `Handle.wait()` after completion makes the caller's stream
    wait for NCCL's (no host wait). `synchronize()` is the same wait for work torch's reducer
    launched in C++ (no handle of ours): an event on the current stream, polled against the abort and
    the timeout. The abort calls `ncclCommAbort`, which releases the kernels stuck on a dead peer.
    """

    device: torch.device

    def __init__(self, spec: GroupSpec, store: dist.Store) -> None:
        super().__init__(spec)
        if not dist.is_nccl_available() or not torch.cuda.is_available():  # not a failed collective: no retry helps
            raise RuntimeError(f"group {spec.name}: NCCL needs a CUDA device and a torch built with NCCL "
                            f"(torch.cuda.is_available() = {torch.cuda.is_available()}, "
                            f"torch.distributed.is_nccl_available() = {dist.is_nccl_available()}); "
                            f"use comm.backend: gloo")
        _nccl_environment(spec.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._prefix = group_store(spec, store)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=spec.timeout_s + NCCL_WATCHDOG_MARGIN_S)
        opts.config.blocking = 0
        self._launch_lock = threading.Lock()
        self._torch_pg: dist.ProcessGroup | None = None
        try:
            self._pg = dist.ProcessGroupNCCL(self._prefix, spec.rank, spec.world_size, opts)
            self._pg._set_sequence_number_for_group()
            self._pg.eager_connect_single_device(self.device)  # the communicator forms now, not at the first step
        except Exception as err:  # noqa: BLE001 - a DistBackendError, a store timeout, a forged value
            raise _formation_error(spec, err, "NCCL group did not form") from None
        self._stream = torch.cuda.Stream(device=self.device)
        self._poller = _EventPoller(self)

    def _submit(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> Handle:
        with self._launch_lock:
            if self.aborted or self._pg is None:
                raise CommAborted(f"group {self.name}: membership epoch aborted ({self.abort_reason})")
            try:
                work = launch()
            except Exception as err:  # noqa: BLE001 - an NCCL error (or a bad argument)
                self.mark_failed()
                raise _backend_error(self.name, err, "NCCL") from None
            done = torch.cuda.Event()
            with torch.cuda.stream(self._stream):
                work.wait()  # the side stream waits for NCCL's; the host does not
                done.record(self._stream)
        cuda_work = _CudaWork(done, self, work)
        handle = Handle(cuda_work, self, keep)
        self._poller.watch(cuda_work)
        return handle

    def barrier(self) -> Handle:
        """An all-reduce of one element (torch's NCCL barrier blocks the host)."""
        return self.all_reduce(torch.zeros(1, device=self.device))

    def process_group(self) -> dist.ProcessGroup | None:
        """A torch ProcessGroup over this NCCL backend that calls itself a group of one, for torch's
        reducer (see `GlooCommunicator.process_group`: the reducer must not divide)."""
        if self._torch_pg is None and self._pg is not None:
            self._torch_pg = _group_of_one(self._prefix, "cuda", dist.ProcessGroup.BackendType.NCCL, self._pg)
        return self._torch_pg

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait, on the host, for everything queued on torch's current stream so far (the reducer's
        buckets included), polling the abort flag and the timeout; on the timeout the communicator is
        aborted. Raises this group's CommError when it failed or was aborted."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        while not event.query():
            if self.aborted or self.failed:
                raise self.failure()
            if time.monotonic() > deadline:
                self.timed_out = True
                self.abort(f"NCCL operation did not finish within {self.timeout_s:.1f}s")
                raise self.failure()
            time.sleep(0.0002)
        if self.aborted or self.failed:
            raise self.failure()

    def abort(self, reason: str = "aborted by coordinator") -> None:
        """Fail every wait at once and abort the NCCL communicator (its kernels, and the peers' waiting
        on this one, are released). A launch blocked inside NCCL is exactly what the abort must
        release, so after a short wait for the launch lock it aborts without it."""
        super().abort(reason)
        locked = self._launch_lock.acquire(timeout=0.5)
        try:
            pg = self._pg
            if pg is not None:
                pg.abort()
        except Exception as err:  # noqa: BLE001 - an abort that fails still leaves the group failed
            log.warning("ncclCommAbort of %s: %s", self.name, err)
        finally:
            if locked:
                self._launch_lock.release()

    def close(self) -> None:
        """Release the communicator in the background: shut down when healthy (once its stream is
        done), abort when failed. Its buffers stay recorded on NCCL's stream until then."""
        self._poller.stop()
        with self._launch_lock:
            pg, self._pg = self._pg, None
        self._torch_pg = None
        if pg is None:
            return
        stream, failed = self._stream, self.failed

        def release() -> None:
            try:
                if failed:
                    pg.abort()
                else:
                    stream.synchronize()
                    getattr(pg, "shutdown", pg.abort)()
            except Exception as err:  # noqa: BLE001
                log.warning("releasing NCCL group %s: %s", self.name, err)

        threading.Thread(target=release, name=f"close {self.name}", daemon=True).start()


class _CudaWork:  # pragma: no cover - needs a GPU
    """Adapts a CUDA event (recorded after a torch NCCL work) to the part of c10d.Work that Handle
    uses; `_EventPoller` completes it."""

    def __init__(self, event, comm: NcclCommunicator, work) -> None:
        self.event, self.comm, self.work = event, comm, work
        self.deadline = time.monotonic() + comm.timeout_s
        self._future = torch.futures.Future()

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        if not self.event.query():
            raise CommError(f"group {self.comm.name}: NCCL operation did not complete (aborted)")
        try:
            self.work.wait()  # the caller's stream waits for NCCL's (done already: no host wait)
        except Exception as err:  # noqa: BLE001
            raise _backend_error(self.comm.name, err, "NCCL") from None


class _EventPoller:  # pragma: no cover - needs a GPU
    """One thread per communicator: completes each operation's work when its event fires, or when the
    epoch is aborted, or at its deadline (then it aborts the communicator: a timeout)."""

    def __init__(self, comm: NcclCommunicator) -> None:
        self._comm = comm
        self._works: list[_CudaWork] = []
        self._cv = threading.Condition()
        self._stopped = False
        threading.Thread(target=self._run, name=f"poll {comm.name}", daemon=True).start()

    def watch(self, work: _CudaWork) -> None:
        with self._cv:
            self._works.append(work)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._works and not self._stopped:
                    self._cv.wait()
                if self._stopped and not self._works:
                    return
                works = list(self._works)
            now = time.monotonic()
            finished = [w for w in works if self._comm.aborted or w.event.query() or now > w.deadline]
            if any(now > w.deadline and not w.event.query() for w in finished) and not self._comm.aborted:
                self._comm.timed_out = True
                self._comm.abort(f"NCCL operation did not finish within {self._comm.timeout_s:.1f}s")
            with self._cv:
                self._works = [w for w in self._works if w not in finished]
            for work in finished:
                work.get_future().set_result(None)
            if not finished:
                time.sleep(0.0002)


# --------------------------------------------------------------------------- store and factory
_client_stores: dict[tuple[str, int], dist.Store] = {}
"""In-process stores that tests register under made-up addresses (no TCP)."""


def client_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client connection of its own for one group's formation. A TCPStore client runs one operation
    at a time: a formation abandoned for a newer epoch still blocks in C++ on its wait for peers that
    never come (up to its timeout), and a shared connection would hold every later formation of the
    process behind it. The group keeps its connection; it closes when the group is released."""
    local = _client_stores.get((host, port))
    if local is not None:
        return local
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


def form_in_thread(spec: GroupSpec, build: Callable[[], BaseCommunicator],
                   stop: Callable[[], bool]) -> BaseCommunicator | None:
    """`build()` a group in a helper thread; None if `stop()` turns true meanwhile.

    Group construction blocks in C++ until every member arrives (NCCL's init has no timeout of its
    own): after `spec.timeout_s` (plus a margin for gloo's own) the attempt is abandoned with
    CommTimeout. Any error while forming comes back here with its own text; a group that forms after
    it was abandoned is closed."""
    result: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["comm"] = build()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread, whatever it is
            result["error"] = err
        finally:
            done.set()
            if result.get("abandoned") and "comm" in result:
                result["comm"].close()

    threading.Thread(target=run, name=f"form {spec.name}", daemon=True).start()
    deadline = time.monotonic() + spec.timeout_s + 5.0
    while not done.wait(0.02):
        if stop() or time.monotonic() > deadline:
            result["abandoned"] = True
            if done.is_set() and "comm" in result:
                result["comm"].close()
            if time.monotonic() > deadline:
                raise CommTimeout(f"group {spec.name}: did not form within {spec.timeout_s + 5.0:.0f}s")
            return None
    if "error" in result:
        raise result["error"]
    return result["comm"]


_in_process_stores = itertools.count()


def in_process_store() -> tuple[str, int]:
    """A `HashStore` that this process's communicators reach under a made-up address (no TCP)."""
    key = ("local-store", next(_in_process_stores) + 1)
    _client_stores[key] = dist.HashStore()
    return key


def in_process_group(n: int, name: str = "local", timeout_s: float = 10.0) -> list[BaseCommunicator]:
    """n members of one gloo group, formed in threads of this process (tests)."""
    host, port = in_process_store()
    specs = [GroupSpec(host, port, name, r, n, timeout_s, "gloo", "127.0.0.1") for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(make_communicator, specs))


def make_communicator(spec: GroupSpec) -> BaseCommunicator:
    """Form the group of one membership epoch (blocks until every member arrives or timeout)."""
    try:
        store = client_store(spec.store_host, spec.store_port, spec.timeout_s)
    except Exception as err:  # noqa: BLE001
        raise CommError(f"store {spec.store_host}:{spec.store_port} unreachable: {str(err).splitlines()[0][:200]}") from None
    if spec.backend == "nccl":
        return NcclCommunicator(spec, store)
    return GlooCommunicator(spec, store)
