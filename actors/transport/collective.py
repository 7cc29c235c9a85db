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


class _Staged:
    """The tensors an operation of `comm` runs on for the user's tensors or arrays: the user's own, except on
    a group whose device is a GPU (NCCL, which takes device tensors only), where a CPU tensor or a NumPy
    array is copied to the device first and the result copied back (`back`). A value of another type is
    refused with a TypeError before anything is launched, so the group is not failed by it."""

    def __init__(self, comm: BaseCommunicator, tensors: Any) -> None:
        device = getattr(comm, "device", None)
        self.users = [_as_torch(t) for t in tensors]
        self.on_device = [t.to(device) if device is not None and device.type == "cuda" and t.device != device else t
                          for t in self.users]

    def back(self) -> None:
        for mine, ran in zip(self.users, self.on_device):
            if ran is not mine:
                mine.copy_(ran)


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
            op, staged = _op(allreduce_options), _Staged(self.communicator, tensors)
            for handle in [self.communicator.all_reduce(t, op) for t in staged.on_device]:
                handle.wait()
            staged.back()

        def barrier(self, barrier_options=None) -> None:
            self.communicator.barrier().wait()

        def reduce(self, tensors, reduce_options=None) -> None:
            """The reduction lands in the root's tensor; the others' tensors are left as they were."""
            root, op, staged = getattr(reduce_options, "root_rank", 0), _op(reduce_options), _Staged(self.communicator, tensors)
            for t in staged.on_device:
                buf = t if self.rank == root else t.clone()
                self.communicator.all_reduce(buf, op).wait()
            staged.back()

        def broadcast(self, tensors, broadcast_options=None) -> None:
            root, staged = getattr(broadcast_options, "root_rank", 0), _Staged(self.communicator, tensors)
            for handle in [self.communicator.broadcast(t, root) for t in staged.on_device]:
                handle.wait()
            staged.back()

        def allgather(self, tensor_lists, tensors, allgather_options=None) -> None:
            for outputs, t in zip(tensor_lists, tensors):
                outs, ins = _Staged(self.communicator, outputs), _Staged(self.communicator, [t])
                self.communicator.all_gather(outs.on_device, ins.on_device[0]).wait()
                outs.back()

        def reducescatter(self, tensors, tensor_lists, reducescatter_options=None) -> None:
            """Each rank's output is the reduction of every rank's chunk for it: a reduce-scatter (each rank
            sends the others' chunks, (n-1)/n of its input, where an all-reduce sends twice that)."""
            op = _op(reducescatter_options)
            for out, chunks in zip(tensors, tensor_lists):
                outs, ins = _Staged(self.communicator, [out]), _Staged(self.communicator, chunks)
                self.communicator.reduce_scatter(outs.on_device[0], ins.on_device, op).wait()
                outs.back()

        def send(self, tensors, send_options) -> None:
            staged = _Staged(self.communicator, tensors)
            for t in staged.on_device:
                self.communicator.send(t, send_options.dst_rank).wait()

        def recv(self, tensors, recv_options) -> None:
            staged = _Staged(self.communicator, tensors)
            for t in staged.on_device:
                self.communicator.recv(t, recv_options.src_rank).wait()
            staged.back()

    _CLASS = EpochGroup
    return _CLASS
