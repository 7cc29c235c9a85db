"""The CPU communicator: torch's `ProcessGroupGloo` on a `PrefixStore` of the group's name over the
coordinator's `TCPStore`, with its device bound to the node's address.

ray.util.collective's gloo backend is not used: it creates torch's default process group once per
process, blocks, ignores the timeout and takes a process-wide lock while a group forms.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # not in torch's stub

from actors.transport.base import TorchBackendCommunicator, WorkHandle
from actors.transport.formation import form_in_thread, formation_error, group_of_one, release, spawn, torch_group
from actors.transport.shm import REDUCE_OPS, Offer, SharedMemoryGroup, Unusable, obstacle, slot_bytes
from actors.transport.shm import available as shm_available
from actors.transport.shm import sweep as shm_sweep
from actors.transport.signed_store import group_store
from actors.transport.sockets import device_and_address, pairs, prepare_device, shut_down, shut_down_pairs
from actors.transport.stores import prepare_client
from core.comm_api import CommAborted, CommError, GroupSpec

log = logging.getLogger(__name__)


def _offer(spec: GroupSpec) -> tuple[SharedMemoryGroup | None, Offer]:
    """This member's shared memory for the group, made before the group forms, and what it publishes of it."""
    try:
        shm = SharedMemoryGroup(spec.rank, spec.world_size, slot_bytes(spec.reduce_bytes))
    except Unusable as err:
        return None, Offer(refused=str(err))
    return shm, shm.offer


class GlooCommunicator(TorchBackendCommunicator):
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

    def __init__(self, spec: GroupSpec, store: dist.Store, shared_memory: bool = True) -> None:
        """`shared_memory`: all-reduce through shared memory where every member runs on this node
        (actors/transport/shm.py); a subgroup forms without it."""
        super().__init__(spec)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub lists only Options
        opts._timeout = datetime.timedelta(seconds=spec.forming_s)  # its connections' set-up; operations: below
        device, self._listen = device_and_address(spec.node_ip)
        opts._devices = [device]
        prefix = group_store(spec, store)
        self._prefix = prefix
        self._store = store
        self._children: list[GlooCommunicator] = []
        """Subgroups formed from this group (`subgroup`): aborted and released with it."""
        self._torch_pg: dist.ProcessGroup | None = None
        self._ranked_pg: dist.ProcessGroup | None = None
        """`ranked_group()`'s, once lent."""
        self._peers: set[tuple[str, int]] = set()
        """The peers' gloo listening addresses (a pair is a connection to one of them, or from one)."""
        self._shm: SharedMemoryGroup | None = None
        """The shared-memory all-reduce, where every member is on this node and every one attached."""
        self.shm_fallback: str | None = None
        """Why its members, all on this node's address, all-reduce through gloo instead of shared memory
        (one line, the same on every member; None: they do not, or shared memory is off)."""
        self._held: list[socket.socket] | None = None
        """A duplicate of each of the group's pairs, found once its first step committed (`settled`): an
        abort then shuts them down without looking through the process's descriptors (5 ms of a re-form
        here, on two busy cores). None until then: the abort looks."""
        shm: SharedMemoryGroup | None = None
        try:
            offer = None
            if shared_memory and spec.world_size > 1 and self._listen is not None and shm_available():
                # made before the group forms, so that every member's exists once it has formed
                shm, offer = _offer(spec)
            mine = f"{self._listen[0]} {self._listen[1]}" if self._listen else ""
            prefix.set(f"gloo-listen/{spec.rank}", f"{mine} {offer.encode()}" if offer is not None else mine)
            self._pg = dist.ProcessGroupGloo(prefix, spec.rank, spec.world_size, opts)
            if spec.forming_s != spec.timeout_s:  # formed: gloo's own deadline for each operation
                self._pg.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
            offers: list[Offer | None] = [offer] * spec.world_size
            others = [r for r in range(spec.world_size) if r != spec.rank]
            for r, value in zip(others, prefix.multi_get([f"gloo-listen/{r}" for r in others]) if others else []):
                host, port, rest = (value.decode().split(" ", 2) + ["", "", ""])[:3]
                if port:
                    self._peers.add((host, int(port)))
                offers[r] = Offer.decode(rest)
            if offer is not None:  # every member decides alike: each one's offer is made, published or refused
                self._share_memory(shm, offers)
        except Exception as err:  # noqa: BLE001
            if shm is not None and self._shm is None:
                shm.close()
            raise formation_error(spec, err, "could not form") from None

    def _share_memory(self, shm: SharedMemoryGroup | None, offers: list[Offer | None]) -> None:
        """Use shared memory where every member's gloo device is on this node's address, every member
        made its file on the same node (`obstacle`), and every member then opened every peer's: each
        attaches at once and tells the others, through the group's store, whether it could. Else every
        member keeps gloo, and where shared memory was possible a warning (and `shm_fallback`) says why."""
        assert self._listen is not None  # an offer is made only with it
        if len(self._peers) != self.world_size - 1 or any(h != self._listen[0] for h, _ in self._peers):
            reason: str | None = ""  # another node: gloo, as expected
        else:
            reason = obstacle(offers)
        if reason is None and shm is not None:
            try:
                shm.attach([o.name for o in offers if o is not None])
                attached = "ok"
            except Unusable as err:
                attached = f"rank {self.rank}: {err}"
            self._prefix.set(f"shm/{self.rank}", attached)
            failed = [v.decode() for v in self._prefix.multi_get([f"shm/{r}" for r in range(self.world_size)]) if v != b"ok"]
            reason = "; ".join(failed) if failed else None
        if reason is None and shm is not None:
            shm.attached()  # every member opened every file and pipe: nothing needs them by name
            self._shm = shm
            return
        if shm is not None:
            shm.close()
        if reason:
            self.shm_fallback = f"shared memory unavailable ({reason}): group {self.name} all-reduces through gloo"
            log.warning("%s", self.shm_fallback)

    def _abort_pairs(self, reason: str) -> None:
        super().abort(reason)
        if self._shm is not None:
            self._shm.wake()
        with self._lock:
            if self._pg is None or not self._lent:
                return
            if self._listen is None:
                log.warning("group %s: its gloo listening address is unknown: an operation stuck in C++ waits "
                            "for its timeout (%.0fs)", self.name, self.timeout_s)
                return
            shut = shut_down(self._held) if self._held is not None else shut_down_pairs(self._listen, self._peers)
        log.info("group %s aborted (%s): shut down %d gloo connections", self.name, reason, shut)

    def settled(self) -> None:
        """Its first step committed: in a helper thread, hold a duplicate of each of its pairs (only a
        group lent to torch is shut down so, `_abort_pairs`), and make the next group's device and store
        connection ahead."""
        spawn(self._settle)

    def _settle(self) -> None:
        if self._listen is not None and self._lent:
            try:
                found = pairs(self._listen, self._peers)
                with self._lock:  # an abort or a close meanwhile found (or needs) none of them
                    if self._pg is not None and not self.aborted and self._held is None:
                        self._held, found = found, []
                for sock in found:
                    sock.close()
            except Exception as err:  # noqa: BLE001 - an abort then looks for the pairs itself, as before
                log.warning("group %s: could not find its pairs ahead: %s", self.name, err)
        if self._shm is not None:
            try:
                shm_sweep()
            except Exception as err:  # noqa: BLE001 - a leftover file costs a few kB; the next settle tries again
                log.warning("group %s: could not sweep shared-memory leftovers: %s", self.name, err)
        for ahead in (lambda: prepare_device(self.spec.node_ip),
                      lambda: prepare_client(self.spec.store_host, self.spec.store_port, self.spec.timeout_s)):
            try:
                ahead()
            except Exception as err:  # noqa: BLE001 - the next formation makes its own, as before
                log.warning("group %s: could not prepare the next group's device or store connection: %s", self.name, err)

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
        child = form_in_thread(spec, lambda: GlooCommunicator(spec, self._store, shared_memory=False), lambda: self.aborted)
        if child is None:
            raise self.failure()
        return child

    def abort(self, reason: str = "aborted by coordinator") -> None:
        self._abort_pairs(reason)
        with self._lock:
            children = list(self._children)
        for child in children:
            child.abort(reason)

    def _submit(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> WorkHandle:
        self._check()
        return WorkHandle(launch(), self, keep)

    def _submit_futureless(self, launch: Callable[[], Any], keep: Sequence[torch.Tensor]) -> WorkHandle:
        """Gloo's send, recv and reduce-scatter works have no future: a thread waits for each (`_WaitedWork`)."""
        self._check()
        return WorkHandle(_WaitedWork(launch()), self, keep)

    def _submit_exchange(self, launch: Callable[[], list[Any]], keep: Sequence[torch.Tensor]) -> WorkHandle:
        """Gloo buffers its sends, so the exchange's sends and receives are issued one by one; one handle
        completes once every one of them has (`_AllWorks`)."""
        self._check()
        return WorkHandle(_AllWorks([_WaitedWork(work) for work in launch()]), self, keep)

    def barrier(self) -> WorkHandle:
        self._check()
        return self._timed(WorkHandle(self._pg.barrier(), self, ()), "barrier")

    def process_group(self) -> dist.ProcessGroup | None:
        """A torch ProcessGroup over this group's gloo backend that calls itself a group of one (rank
        0 of 1): torch's reducer divides every bucket by its group's size before the all-reduce, and
        here the gradients arrive already weighted by each member's share of the global batch, so the
        sum is the mean. The all-reduce itself runs on the gloo backend, across the whole group, or
        through shared memory where every member is on this node (`SharedMemoryProcessGroup`)."""
        if self._torch_pg is None and self._pg is not None:
            self._torch_pg = (SharedMemoryProcessGroup(self) if self._shm is not None else
                              group_of_one(self._prefix, "cpu", dist.ProcessGroup.BackendType.GLOO, self._pg))
        return self._torch_pg

    def ranked_group(self) -> dist.ProcessGroup | None:
        """A torch ProcessGroup of this member's rank and the group's size over its gloo backend (gloo's
        own collectives: never shared memory), named after the group and the rank (unique in a process
        even where several members of one group run in its threads)."""
        if self._ranked_pg is None and self._pg is not None:
            self._ranked_pg = torch_group(self._prefix, "cpu", dist.ProcessGroup.BackendType.GLOO, self._pg,
                                          self.rank, self.world_size, f"{self.name}@{self.rank}")
        return self._ranked_pg

    @property
    def _lent(self) -> bool:
        """Whether torch holds this group's backend (its reducer or FSDP): an operation may then block in C++."""
        return self._torch_pg is not None or self._ranked_pg is not None

    @property
    def shared_memory(self) -> bool:
        """Whether its all-reduces go through shared memory (every member on this node)."""
        return self._shm is not None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> WorkHandle | SharedMemoryHandle:  # type: ignore[override]
        if not self._through_shm(tensor, op):
            return super().all_reduce(tensor, op)
        if tensor.numel() == 0:
            return SharedMemoryHandle(self, 0)  # nothing to reduce: complete at once, as gloo's
        try:
            return SharedMemoryHandle(self, self._shm_call(lambda shm: shm.launch(tensor, op, self.timeout_s, self._aborted,
                                                                                    self.name)))
        except CommError as err:
            return SharedMemoryHandle(self, 0, err)
        finally:
            self.bytes_sent += tensor.numel() * tensor.element_size()

    def _through_shm(self, tensor: torch.Tensor, op: str) -> bool:
        """Every member decides alike: same op, same tensor sizes, same modelled latency (the lab keeps gloo)."""
        shm = self._shm
        return (shm is not None and op in REDUCE_OPS and tensor.device.type == "cpu" and not self.models_latency
                and tensor.numel() * tensor.element_size() <= shm.slot)

    def gloo_allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work:
        """Gloo's own all-reduce of a group that otherwise reduces through shared memory: an op shared
        memory does not implement (gloo runs it, or refuses it as it does)."""
        self._check()
        return self._pg.allreduce(tensors, opts)

    def finish_shm(self, k: int, timeout: float | None = None) -> None:
        """Wait for shared-memory operation `k` (and those before it) to finish, within `timeout` (the
        group's by default)."""
        limit = self.timeout_s if timeout is None else timeout
        self._shm_call(lambda shm: shm.finish(k, limit, self._aborted, self.name))

    def _aborted(self) -> bool:
        return self.aborted

    def _shm_call(self, call: Callable[[SharedMemoryGroup], Any]) -> Any:
        self._check()
        shm = self._shm
        if shm is None:
            raise self.failure()  # closed meanwhile
        try:
            return call(shm)
        except CommError as err:
            self.mark_failed()
            if self.error is None and not self.aborted:
                self.error = err
            raise self.failure() if self.aborted else err from None

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
            held, self._held = self._held or [], None
        for sock in held:
            sock.close()  # the duplicates: gloo's own descriptors close with the group
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
        for child in children:
            child.close()
        lent, ranked, self._torch_pg, self._ranked_pg = self._torch_pg, self._ranked_pg, None, None
        with self._lock:
            works = [h._work for h in self._pending]
            self._pending.clear()
        if pg is not None:
            deadline = time.monotonic() + self.timeout_s + 5.0
            hold = (lent is not None or ranked is not None) and self.failed
            spawn(release, (pg, lent, ranked), works, deadline, hold)


class SharedMemoryHandle:
    """A shared-memory all-reduce launched (`GlooCommunicator.all_reduce`): its wait finishes it, or
    raises the error its launch met."""

    __slots__ = ("_comm", "_k", "_error")

    def __init__(self, comm: GlooCommunicator, k: int, error: CommError | None = None) -> None:
        self._comm, self._k, self._error = comm, k, error

    def is_completed(self) -> bool:
        shm = self._comm._shm
        return self._error is not None or shm is None or shm.finished >= self._k

    def wait(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise self._error
        self._comm.finish_shm(self._k, timeout)


_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
"""The torch reduce ops a `SharedMemoryProcessGroup` runs through `GlooCommunicator.all_reduce`."""


class SharedMemoryProcessGroup(dist.ProcessGroup):
    """What torch's reducer sees of a group whose all-reduces go through shared memory: a torch
    ProcessGroup of one (rank 0 of 1, so the reducer does not divide), implemented in Python, whose
    all-reduce runs across the whole group at once (the reducer calls it from backward, holding the
    GIL; the wait releases it) and returns a completed work. A failure raises the group's CommError out
    of backward (the policy then drops its reducer)."""

    def __init__(self, comm: GlooCommunicator) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # the stub lists only (store, rank, size); pybind has (rank, size)
        self._comm = comm

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        if isinstance(opts, dist.AllreduceOptions):
            op = _OP_NAMES.get(opts.reduceOp.op)  # type: ignore[attr-defined]  # a ReduceOp: its op is the RedOpType
            if op is None:
                return self._comm.gloo_allreduce(tensors, opts)
        else:
            op = "sum"  # torch's default
        for tensor in tensors:  # through shared memory, or gloo for a bucket larger than a slot (`all_reduce`)
            self._comm.all_reduce(tensor, op).wait()
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(tensors)
        return _create_work_from_future(future)

    def getBackendName(self) -> str:
        return "gloo (shared memory)"


class _FutureWork:
    """A work whose completion is a future of its own (gloo's point-to-point works have none)."""

    _future: torch.futures.Future[None]

    def get_future(self) -> torch.futures.Future[None]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class _AllWorks(_FutureWork):
    """Several works as one: complete when every one is; `wait` raises the first one's error."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works
        self._future = torch.futures.Future()
        self._left = len(works)
        self._lock = threading.Lock()
        if not works:
            self._future.set_result(None)
        for work in works:
            work.get_future().add_done_callback(self._one_done)

    def _one_done(self, _future: Any) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._future.set_result(None)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class _WaitedWork(_FutureWork):
    """Gloo's send, recv and reduce-scatter works have no future (`Work::getFuture not implemented`) and are complete
    only once waited on: a daemon thread waits (within the group's own timeout) and completes one,
    keeping the outcome for `Handle.wait`."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work
        self._error: Exception | None = None
        self._future = torch.futures.Future()
        threading.Thread(target=self._run, name="gloo p2p", daemon=True).start()

    def _run(self) -> None:
        try:
            self._work.wait()
        except Exception as err:  # noqa: BLE001 - re-raised by wait(), where Handle turns it into CommError
            self._error = err
        self._future.set_result(None)

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
