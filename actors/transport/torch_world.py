"""A membership epoch's group lent to torch.distributed as the world of its process, for torch code that
finds its groups there (FSDP's `fully_shard` over a `DeviceMesh`: the mesh asks torch's default group for
this process's rank, and resolves its groups by name).

The project never calls `init_process_group`: a group is formed per membership epoch and released at the
next one (actors/transport/gloo.py, nccl.py), and torch's default group is made once per process. So an
epoch's sharding group is *lent*: `lend(group)` registers the group's ranked `ProcessGroup` in torch's
bookkeeping as the default group, with global ranks equal to its own ranks, and `LentWorld.give_back()`
removes it before the group is released. One group is lent at a time in a process (the sharding group of
a replica); lending another first gives the previous one back. `borrow(group)` makes another group known for a
helper thread's collectives (a checkpoint written in the background has a group of its own: collectives of two
threads on one group could be issued in different orders on different members).

Replicas that run in threads of one process (the in-process tests) each need their own world:
`per_thread()` makes torch's bookkeeping thread-local, as torch's own multi-threaded test groups do. The
autograd engine must then run backward in the calling thread (it does on the CPU).
"""
from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_lock = threading.Lock()


class LentWorld:
    """One group known to torch (by name and ranks, and as its default group where `default`), until
    `give_back()`."""

    def __init__(self, group: dist.ProcessGroup, backend: str, default: bool = True) -> None:
        """`default`: the group becomes the default group (else torch only knows it by name and ranks)."""
        self.group = group
        world = c10d._world
        if isinstance(world, _ThreadWorlds):  # this thread's own: a give-back from another thread finds it
            world = world._get()
        world.pg_map[group] = (backend, None)  # type: ignore[assignment]  # no store: torch forms no group from it
        world.pg_names[group] = group.group_name
        world.pg_group_ranks[group] = {r: r for r in range(group.size())}
        world.pg_backend_config[group] = f"{'cuda' if backend == 'nccl' else 'cpu'}:{backend}"
        if default:
            world.default_pg = group
        c10d._register_process_group(group.group_name, group)
        self._world = world
        self.lent = True

    def give_back(self) -> None:
        """torch forgets the group (the group itself is released by its communicator)."""
        if not self.lent:
            return
        self.lent = False
        world, group = self._world, self.group
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
            table.pop(group, None)
        if world.default_pg is group:
            world.default_pg = None
        try:
            c10d._unregister_process_group(group.group_name)
        except Exception:  # noqa: BLE001 - already unregistered: nothing to forget
            pass


_current = threading.local()


def lend(group: dist.ProcessGroup, backend: str) -> LentWorld:
    """Lend `group` (a communicator's `ranked_group()`) as this process's (or, after `per_thread()`, this
    thread's) torch world; the group lent before it is given back first."""
    previous: LentWorld | None = getattr(_current, "world", None)
    if previous is not None:
        previous.give_back()
    with _lock:
        lent = LentWorld(group, backend)
    _current.world = lent
    return lent


def borrow(group: dist.ProcessGroup, backend: str) -> LentWorld:
    """`group` known to torch for a helper thread's collectives over it (a checkpoint's writer): registered,
    and, where each thread has its own world (`per_thread`), this thread's default group too (a process's
    default group stays the one `lend` lent). Given back with `give_back()`."""
    with _lock:
        return LentWorld(group, backend, default=isinstance(c10d._world, _ThreadWorlds))


class _ThreadWorlds:
    """torch's `_World` bookkeeping, one per thread (the fields `distributed_c10d` reads and writes)."""

    _local = threading.local()

    def _get(self) -> Any:
        if not hasattr(self._local, "world"):
            self._local.world = c10d._World()
        return self._local.world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._get(), name, value)


def per_thread() -> None:
    """torch's distributed bookkeeping becomes thread-local (replicas in threads of one process); once."""
    with _lock:
        if not isinstance(c10d._world, _ThreadWorlds):
            c10d._world = _ThreadWorlds()  # type: ignore[assignment]  # duck-typed: every field it reads
