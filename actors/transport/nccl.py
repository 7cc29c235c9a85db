"""The GPU communicator: torch's `ProcessGroupNCCL`, one per membership epoch, with this interface's
timeout and abort on top (a CUDA event per operation, completed by one poller thread per group)."""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from actors.streams import process_stream
from actors.transport.base import TorchBackendCommunicator, WorkHandle, backend_error
from actors.transport.formation import formation_error, group_of_one, torch_group
from actors.transport.signed_store import group_store
from core.comm_api import CommAborted, CommError, GroupSpec

log = logging.getLogger(__name__)


NCCL_WATCHDOG_MARGIN_S = 30.0
"""torch's own NCCL watchdog times an operation out this long after `comm.timeout_s`: the poller of
this module aborts first (and keeps the process); the watchdog is only the backstop."""


def _nccl_environment(timeout_s: float, node_ip: str) -> None:
    """What torch's NCCL backend reads at a group's construction, set where the user did not:
    on an error or a timeout, abort the communicator and keep the process (the default tears the
    process down, which would turn a peer's death into this worker's), never a host-blocking wait (a
    user's `TORCH_NCCL_BLOCKING_WAIT` is turned off, with a warning); a non-blocking communicator's
    initialization gives up after the group's timeout; NCCL's bootstrap and socket transport use the
    interface that owns the node's address (`NCCL_SOCKET_IFNAME`), the one the job reaches this node
    by: left to choose, NCCL may take another interface of a host with several, which a peer cannot
    reach (the group's formation then hangs until its timeout)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("0", ""):
        # `work.wait()` would block the host until the operation finishes, inside the backward hooks
        # that launch it: the overlap of communication with backward is lost, and an abort cannot
        # release the launching thread. This module's poller gives the timeout and the abort instead.
        log.warning("TORCH_NCCL_BLOCKING_WAIT=%s ignored: NCCL groups wait on CUDA events, with "
                    "comm.timeout_s and an abort of their own", os.environ["TORCH_NCCL_BLOCKING_WAIT"])
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(int(max(1.0, timeout_s))))
    if "NCCL_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(node_ip)
        if interface is not None:
            os.environ["NCCL_SOCKET_IFNAME"] = f"={interface}"  # exactly this one, not every name it prefixes


def interface_of(address: str, interfaces: dict[str, list[str]] | None = None) -> str | None:
    """The network interface that holds `address` (`interfaces`: each interface's addresses; this
    host's by default), or None where none does (a loopback address is left to NCCL)."""
    if interfaces is None:
        import psutil

        interfaces = {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
                      for name, addrs in psutil.net_if_addrs().items()}
    if address.startswith("127.") or address == "::1":
        return None
    return next((name for name, addrs in interfaces.items() if address in addrs), None)


def nccl_fault(pg: Any) -> str | None:
    """The error NCCL's own machinery recorded on `pg` (a communicator its watchdog aborted, a peer's
    remote error), in words; None while it has none or where this torch cannot tell (`get_error` is
    newer than some builds). An operation whose event fired on such a communicator read a partial sum."""
    get_error = getattr(pg, "get_error", None)
    if get_error is None:
        return None
    try:
        error = get_error()
    except Exception as err:  # noqa: BLE001 - asking a torn-down communicator
        return f"{type(err).__name__}: {err}"
    name = getattr(error, "name", str(error))
    return None if name.endswith("SUCCESS") else f"NCCL reported {name}"


class DeviceDeadline:
    """An operation's deadline counted from when it can start on the device, not from its launch on
    the host, which runs ahead of the GPU by whatever compute is queued (a long backward): `started`
    says whether the stream it was launched behind has reached it (a CUDA event's `query`)."""

    def __init__(self, started: Callable[[], bool], timeout_s: float) -> None:
        self._started, self.timeout_s = started, timeout_s
        self.started_at: float | None = None

    def overdue(self, now: float) -> bool:
        if self.started_at is None:
            if not self._started():
                return False
            self.started_at = now
        return now > self.started_at + self.timeout_s


_release_lock = threading.Lock()
_releasing: list[threading.Thread] = []
"""The previous group's release, running: a group's close waits for it first, so quick successive
reshapes hold at most one released group's buffers besides the live one's."""


class NcclCommunicator(TorchBackendCommunicator):  # pragma: no cover - needs a GPU (tests/gpu)
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
        _nccl_environment(spec.forming_s, spec.node_ip)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._prefix = group_store(spec, store)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=spec.timeout_s + NCCL_WATCHDOG_MARGIN_S)
        opts.config.blocking = 0
        self._launch_lock = threading.Lock()
        self._torch_pg: dist.ProcessGroup | None = None
        self._ranked_pg: dist.ProcessGroup | None = None
        try:
            self._pg = dist.ProcessGroupNCCL(self._prefix, spec.rank, spec.world_size, opts)
            self._pg._set_sequence_number_for_group()
            self._pg.eager_connect_single_device(self.device)  # the communicator forms now, not at the first step
        except Exception as err:  # noqa: BLE001 - a DistBackendError, a store timeout, a forged value
            raise formation_error(spec, err, "NCCL group did not form") from None
        self._stream = process_stream("nccl completions", self.device)  # one per process, not per epoch
        self._poller = _EventPoller(self)

    def _submit(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> WorkHandle:
        with self._launch_lock:
            if self.aborted or self._pg is None:
                raise CommAborted(f"group {self.name}: membership epoch aborted ({self.abort_reason})")
            started = torch.cuda.Event()
            started.record(torch.cuda.current_stream(self.device))  # NCCL's stream starts no earlier
            try:
                work = launch()
            except Exception as err:  # noqa: BLE001 - an NCCL error (or a bad argument)
                self.mark_failed()
                raise backend_error(self.name, err, "NCCL") from None
            done = torch.cuda.Event()
            with torch.cuda.stream(self._stream):
                work.wait()  # the side stream waits for NCCL's; the host does not
                done.record(self._stream)
        cuda_work = _CudaWork(done, self, work, DeviceDeadline(started.query, self.timeout_s))
        handle = WorkHandle(cuda_work, self, keep)
        self._poller.watch(cuda_work)
        return handle

    def _submit_exchange(self, launch: Callable[[], list[Any]], keep: Sequence[torch.Tensor]) -> WorkHandle:
        """The exchange's sends and receives as one NCCL group (ncclGroupStart/End, as torch's
        `batch_isend_irecv` issues them): issued one by one on the communicator's one stream, a rank's
        send waits for its peer's receive, which waits behind that peer's own send, and a ring of them
        deadlocks. The group's one work stands for all of them."""
        def grouped() -> Any:
            self._pg._start_coalescing(self.device)
            try:
                launch()
            finally:
                work = self._pg._end_coalescing(self.device)
            return work
        return self._submit(grouped, keep)

    def barrier(self) -> WorkHandle:
        """An all-reduce of one element (torch's NCCL barrier blocks the host)."""
        return self.all_reduce(torch.zeros(1, device=self.device))

    def process_group(self) -> dist.ProcessGroup | None:
        """A torch ProcessGroup over this NCCL backend that calls itself a group of one, for torch's
        reducer (see `GlooCommunicator.process_group`: the reducer must not divide)."""
        if self._torch_pg is None and self._pg is not None:
            self._torch_pg = group_of_one(self._prefix, "cuda", dist.ProcessGroup.BackendType.NCCL, self._pg)
        return self._torch_pg

    def ranked_group(self) -> dist.ProcessGroup | None:
        """A torch ProcessGroup of this member's rank and the group's size over this NCCL backend (FSDP's:
        its collectives run on NCCL's own streams, under the communicator's watchdog)."""
        if self._ranked_pg is None and self._pg is not None:
            self._ranked_pg = torch_group(self._prefix, "cuda", dist.ProcessGroup.BackendType.NCCL, self._pg,
                                          self.rank, self.world_size, f"{self.name}@{self.rank}")
        return self._ranked_pg

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
        if self.check_fault() is not None or self.aborted or self.failed:
            raise self.failure()

    def check_fault(self) -> str | None:
        """NCCL's own error on this group (what finished read a partial sum), if any, in words; the
        group is failed with it: the step fails and the membership re-forms, as for an error of this
        module's own."""
        fault = nccl_fault(self._pg) if self._pg is not None else None
        if fault is not None and not self.failed:
            self.error = CommError(f"group {self.name}: {fault}")
            self.mark_failed()
        return fault

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
        """Release the communicator in the background: shut down when healthy (once its operations are
        done: an event recorded now on the side stream they completed on), abort when failed. Its
        buffers stay recorded on NCCL's stream until then. A previous group's release still running is
        waited for first (at most `comm.timeout_s`): reshapes in quick succession hold at most one
        released group's buffers besides the live one's."""
        self._poller.stop()
        with self._launch_lock:
            pg, self._pg = self._pg, None
        self._torch_pg = self._ranked_pg = None
        if pg is None:
            return
        failed = self.failed
        drained = torch.cuda.Event()
        drained.record(self._stream)
        with _release_lock:
            previous = list(_releasing)
        for thread in previous:
            thread.join(self.timeout_s)

        def release() -> None:
            try:
                if failed:
                    pg.abort()
                else:
                    drained.synchronize()
                    getattr(pg, "shutdown", pg.abort)()
            except Exception as err:  # noqa: BLE001
                log.warning("releasing NCCL group %s: %s", self.name, err)

        thread = threading.Thread(target=release, name=f"close {self.name}", daemon=True)
        with _release_lock:
            _releasing[:] = [t for t in _releasing if t.is_alive()] + [thread]
        thread.start()


class _CudaWork:  # pragma: no cover - needs a GPU
    """Adapts a CUDA event (recorded after a torch NCCL work) to the part of c10d.Work that Handle
    uses; `_EventPoller` completes it."""

    def __init__(self, event: torch.cuda.Event, comm: NcclCommunicator, work: dist.Work,
                 deadline: DeviceDeadline) -> None:
        self.event, self.comm, self.work, self.deadline = event, comm, work, deadline
        self._future: torch.futures.Future[None] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[None]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        if not self.event.query():
            raise CommError(f"group {self.comm.name}: NCCL operation did not complete (aborted)")
        fault = self.comm.check_fault()
        if fault is not None:
            raise RuntimeError(fault)  # the handle's wait makes it this group's CommError
        try:
            self.work.wait()  # the caller's stream waits for NCCL's (done already: no host wait)
        except Exception as err:  # noqa: BLE001
            raise backend_error(self.comm.name, err, "NCCL") from None


class _EventPoller:  # pragma: no cover - needs a GPU
    """One thread per communicator: completes each operation's work when its event fires, or when the
    epoch is aborted, or at its deadline, `comm.timeout_s` after the device reached it (then it
    aborts the communicator: a timeout)."""

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
            finished = [w for w in works if self._comm.aborted or w.event.query() or w.deadline.overdue(now)]
            if any(w.deadline.overdue(now) and not w.event.query() for w in finished) and not self._comm.aborted:
                self._comm.timed_out = True
                self._comm.abort(f"NCCL operation did not finish within {self._comm.timeout_s:.1f}s")
            with self._cv:
                self._works = [w for w in self._works if w not in finished]
            for work in finished:
                work.get_future().set_result(None)
            if not finished:
                time.sleep(0.0002)
