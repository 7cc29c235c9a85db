"""Each membership epoch's group, reachable through `ray.util.collective`.

A worker forms one group per membership epoch (actors/transport/comm.py). This module registers a backend,
`ORCHESTRATOR`, with `ray.util.collective` (Ray's `register_collective_backend`) and enters every
epoch's group into that process's collective-group table under the group's own name, so a
workload's code can call the usual API on it:

    import ray.util.collective as col
    from orchestrator import collective_group

    name = collective_group()              # this worker's current membership epoch's group
    col.allreduce(tensor, group_name=name)  # gloo on CPU, the worker's NCCL group on GPU
    col.get_rank(name), col.get_collective_group_size(name)

The operations run on the epoch's own communicator, so the project's rules hold for them: every
wait has `comm.timeout_s`, an epoch aborted by the coordinator (a member died) fails a pending or
later operation at once with `CommAborted`, and the step that called it is not committed (the
worker treats it as a failed collective, not as an error in user code). A group leaves the table
when its epoch ends: its name, which is never reused, then answers "not initialized".

Only a worker actor's process has a table (`ray.util.collective` refuses calls outside an actor);
policies whose members form no group (the parameter-server kinds) publish nothing, and
`collective_group()` says so.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from actors.transport.comm import BaseCommunicator, NoGroup

BACKEND = "ORCHESTRATOR"

_live: dict[str, BaseCommunicator] = {}
"""The communicators of this process's published groups, by name."""
_current: str | None = None
NOT_A_WORKER = "this process is not a worker of a running membership epoch"
_no_group_reason = NOT_A_WORKER
_lock = threading.Lock()


def _ray_collective():
    """ray.util.collective's group table and its lock, with this module's backend registered once."""
    from ray.util.collective import collective as col
    from ray.util.collective.backend_registry import _global_registry, register_collective_backend

    if not _global_registry.is_registered(BACKEND):
        register_collective_backend(BACKEND, _backend_class())
    return col


def prepare() -> None:
    """Import ray.util.collective and register this module's backend ahead of the first `publish` (a hot
    spare does it before its adoption: the first epoch's import took 0.13 s of a join here)."""
    _ray_collective()


def _in_worker_process() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray._private.worker.global_worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001 - no Ray, or not connected: nothing to publish into
        return False


def publish(comm: BaseCommunicator, policy: str) -> None:
    """Make `comm` (a membership epoch's group) this process's current collective group."""
    global _current, _no_group_reason
    if isinstance(comm, NoGroup):
        with _lock:
            _current = None
            _no_group_reason = f"policy {policy!r} forms no collective group (its members talk only to the parameter server)"
        return
    if not _in_worker_process():
        return
    col = _ray_collective()
    with _lock:
        _live[comm.name] = comm
        _current = comm.name
    with col._group_mgr_lock:
        if not col._group_mgr.is_group_exist(comm.name):
            col._group_mgr.create_collective_group(BACKEND, comm.world_size, comm.rank, comm.name)


def withdraw(comm: BaseCommunicator | None) -> None:
    """The epoch of `comm` ended: its name leaves the table (and stops being current)."""
    global _current, _no_group_reason
    if comm is None:
        return
    name = comm.name
    with _lock:
        if _live.pop(name, None) is None:
            return
        if _current == name:
            _current = None
            _no_group_reason = "the membership epoch ended; the next one's group is not formed yet"
    col = _ray_collective()
    with col._group_mgr_lock:
        group = col._group_mgr._name_group_map.get(name)
        if group is not None and getattr(group, "communicator", None) is comm:
            del col._group_mgr._name_group_map[name]


def current_group() -> str:
    """The name of this worker's current membership epoch's group (for `ray.util.collective` calls)."""
    with _lock:
        if _current is None:
            raise RuntimeError(f"no collective group: {_no_group_reason}")
        return _current


def _as_torch(tensor: Any) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor
    if isinstance(tensor, np.ndarray):
        return torch.from_numpy(tensor)  # shares the array's memory: results land in place
    raise TypeError(f"the {BACKEND} backend takes torch tensors and numpy arrays, not {type(tensor).__name__}")


_OPS = {"SUM": "sum", "MAX": "max", "MIN": "min"}


def _op(options: Any) -> str:
    op = getattr(getattr(options, "reduceOp", None), "name", "SUM")
    if op not in _OPS:
        raise ValueError(f"the {BACKEND} backend reduces with SUM, MAX or MIN, not {op}")
    return _OPS[op]


_CLASS = None


def _backend_class():
    """The `BaseGroup` subclass (built on first use: importing ray.util.collective costs ~0.1 s)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    class EpochGroup(BaseGroup):
        """`ray.util.collective`'s view of one membership epoch's communicator. Every operation waits
        with the group's timeout and fails at once when the epoch is aborted."""

        def __init__(self, world_size: int, rank: int, group_name: str) -> None:
            super().__init__(world_size, rank, group_name)
            comm = _live.get(group_name)
            if comm is None:
                raise RuntimeError(f"{group_name!r} is not a live membership epoch's group of this worker")
            if (comm.rank, comm.world_size) != (rank, world_size):
                raise ValueError(f"{group_name!r} is rank {comm.rank} of {comm.world_size}, not {rank} of {world_size}")
            self.communicator = comm

        @classmethod
        def backend(cls) -> str:
            return BACKEND

        @classmethod
        def check_backend_availability(cls) -> bool:
            return True

        def destroy_group(self) -> None:
            pass  # the worker owns the communicator and closes it when its epoch ends

        def allreduce(self, tensors, allreduce_options=None) -> None:
            op = _op(allreduce_options)
            for handle in [self.communicator.all_reduce(_as_torch(t), op) for t in tensors]:
                handle.wait()

        def barrier(self, barrier_options=None) -> None:
            self.communicator.barrier().wait()

        def reduce(self, tensors, reduce_options=None) -> None:
            """The reduction lands in the root's tensor; the others' tensors are left as they were."""
            root = getattr(reduce_options, "root_rank", 0)
            for t in tensors:
                t = _as_torch(t)
                buf = t if self.rank == root else t.clone()
                self.communicator.all_reduce(buf, _op(reduce_options)).wait()

        def broadcast(self, tensors, broadcast_options=None) -> None:
            root = getattr(broadcast_options, "root_rank", 0)
            for handle in [self.communicator.broadcast(_as_torch(t), root) for t in tensors]:
                handle.wait()

        def allgather(self, tensor_lists, tensors, allgather_options=None) -> None:
            for outputs, t in zip(tensor_lists, tensors):
                self.communicator.all_gather([_as_torch(o) for o in outputs], _as_torch(t)).wait()

        def reducescatter(self, tensors, tensor_lists, reducescatter_options=None) -> None:
            """Each rank's output is the reduction of every rank's chunk for it (an all-reduce of the
            concatenated chunks: no less exact, and every backend has it)."""
            op = _op(reducescatter_options)
            for out, chunks in zip(tensors, tensor_lists):
                flat = torch.cat([_as_torch(c).reshape(-1) for c in chunks])
                self.communicator.all_reduce(flat, op).wait()
                size = _as_torch(out).numel()
                _as_torch(out).copy_(flat[self.rank * size:(self.rank + 1) * size].view_as(_as_torch(out)))

        def send(self, tensors, send_options) -> None:
            for t in tensors:
                self.communicator.send(_as_torch(t), send_options.dst_rank).wait()

        def recv(self, tensors, recv_options) -> None:
            for t in tensors:
                self.communicator.recv(_as_torch(t), recv_options.src_rank).wait()

    _CLASS = EpochGroup
    return _CLASS
