"""Forming and releasing groups: a formation in a helper thread that an abort abandons, the error a
failed formation raises, torch's views of a group (the reducer's group of one, FSDP's ranked group), and
the background release."""
from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName

from actors.transport.base import Work
from core.comm_api import CommError, CommTimeout, ForgedRendezvous, GroupSpec

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend


class Closable(Protocol):
    """A formed group, as `form_in_thread` sees it: one that forms after it was abandoned is closed."""

    def close(self) -> None: ...


G = TypeVar("G", bound=Closable)


def group_of_one(store: dist.Store, device: str, kind: dist.ProcessGroup.BackendType,
                 backend: Backend) -> dist.ProcessGroup:
    """A torch ProcessGroup that calls itself rank 0 of 1 over `backend` (the whole group's), for
    torch's reducer: it divides by its group's size, and the gradients arrive already weighted."""
    return torch_group(store, device, kind, backend, 0, 1)


def torch_group(store: dist.Store, device: str, kind: dist.ProcessGroup.BackendType, backend: Backend,
                rank: int, size: int, name: str | None = None) -> dist.ProcessGroup:
    """A torch ProcessGroup of rank `rank` of `size` over `backend`, named `name` where given (torch
    resolves a group by its name: a name is unique among the groups of one process)."""
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device(device), kind, backend)
    group._set_default_backend(kind)
    if name is not None:
        group._set_group_name(GroupName(name))
    return group


def formation_error(spec: GroupSpec, err: BaseException, what: str) -> CommError:
    """A group's formation error as this module's: a rendezvous value the group's signed store refused
    stays `ForgedRendezvous` (with the refusal's own sentence, even where the backend wrapped it), any
    other is a CommError with its first line."""
    text = str(err)
    start = text.find("the rendezvous value")
    if isinstance(err, ForgedRendezvous) or (start >= 0 and "not signed with this job's key" in text):
        return ForgedRendezvous(f"group {spec.name}: {text[max(start, 0):].splitlines()[0][:300]}")
    return CommError(f"group {spec.name}: {what}: {text.splitlines()[0][:300]}")


RELEASE_GRACE_S = 0.5
"""How long a group is still held after its operations finished, before its last reference goes."""


def release(pg: object, works: Sequence[Work], deadline: float, hold: bool = False,
            grace_s: float = RELEASE_GRACE_S) -> None:
    """Hold the group (and the buffers its works reference) until they finish or time out; with
    `hold`, until `deadline` whatever the works (operations no one tracks may still be stuck); then
    for `grace_s` more. The backend's destructor joins its worker threads holding the GIL, and a worker
    thread that has just completed an operation may still need the GIL (a Python callback on the
    operation's future, and the release of that callback): destroyed then, the process would freeze
    for good. This thread, not a member's, drops the last reference, once they are idle."""
    while (works or hold) and time.monotonic() < deadline:
        works = [w for w in works if not w.is_completed()]
        time.sleep(0.1)
    time.sleep(grace_s)
    del pg, works


def spawn(target: Callable[..., object], *args: object) -> None:
    """Run `target(*args)` in a new daemon thread, without waiting for that thread to be scheduled.
    `threading.Thread.start` waits until the new thread runs (a context switch and a GIL handoff): on a
    node whose cores are busy, as they are while a dead worker's memory is torn down, a re-form paid that
    wait twice (the old group's release, the new one's formation). `target` catches its own errors."""
    _thread.start_new_thread(target, args)


def form_in_thread(spec: GroupSpec, build: Callable[[], G], stop: Callable[[], bool]) -> G | None:
    """`build()` a group in a helper thread; None if `stop()` turns true meanwhile.

    Group construction blocks in C++ until every member arrives (NCCL's init has no timeout of its
    own): after `spec.forming_s` (plus a margin for gloo's own) the attempt is abandoned with
    CommTimeout. Any error while forming comes back here with its own text; a group that forms after
    it was abandoned is closed."""
    result: dict[str, Any] = {}  # the group or the error, and whether the caller gave up
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

    spawn(run)
    deadline = time.monotonic() + spec.forming_s + 5.0
    while not done.wait(0.02):
        if stop() or time.monotonic() > deadline:
            result["abandoned"] = True
            if done.is_set() and "comm" in result:
                result["comm"].close()
            if time.monotonic() > deadline:
                raise CommTimeout(f"group {spec.name}: did not form within {spec.forming_s + 5.0:.0f}s")
            return None
    if "error" in result:
        raise result["error"]
    return result["comm"]
