"""Fakes for tests: a communicator peer actor and an in-process world-size-1 communicator.

`CommPeer` hosts one communicator per membership epoch in a long-lived actor process, so
tests can re-form groups in the same processes, kill a peer while its all-reduce is in
flight, and abort an epoch from a control thread, exactly as the worker does.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, Optional

import ray
import torch

from actors.comm import BaseCommunicator, CommError, GroupSpec, make_communicator, serve_store


def wait_until(predicate: Callable[[], Any], timeout: float = 90, what: str = "condition", every: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy and return its value; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


class LoopbackHandle:
    def wait(self, timeout: Optional[float] = None) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class LoopbackComm:
    """World size 1: every collective completes at once and leaves its input as the result."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.calls: list[tuple[str, int]] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> LoopbackHandle:
        self.calls.append(("all_reduce", tensor.numel()))
        return LoopbackHandle()

    def broadcast(self, tensor: torch.Tensor, src: int) -> LoopbackHandle:
        self.calls.append(("broadcast", tensor.numel()))
        return LoopbackHandle()

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> LoopbackHandle:
        outputs[0].copy_(tensor)
        return LoopbackHandle()

    def barrier(self) -> LoopbackHandle:
        return LoopbackHandle()


@ray.remote(num_cpus=0)
class StoreHost:
    """Hosts a TCPStore bound to the node's address (stands in for the coordinator)."""

    def __init__(self, timeout_s: float) -> None:
        self.host = ray.util.get_node_ip_address()
        self.store, self.port, self._sock = serve_store(self.host, timeout_s)

    def address(self) -> tuple[str, int, int]:
        return self.host, self.port, os.getpid()


@ray.remote(num_cpus=0)
class FakeCoordinator:
    """Stands in for the coordinator of a worker actor under test: hosts the store, records every
    call a worker makes, and serves plans it was given (or raises, to mimic a restarting one)."""

    def __init__(self, timeout_s: float) -> None:
        self.host = ray.util.get_node_ip_address()
        self.store, self.port, self._sock = serve_store(self.host, timeout_s)
        self.plans: dict = {}
        self.calls: list[tuple[str, Any]] = []
        self.plan_error: Optional[str] = None

    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def fail_get_plan(self, message: Optional[str]) -> None:
        self.plan_error = message

    def get_plan(self, version: int):
        self.calls.append(("get_plan", version))
        if self.plan_error:
            raise RuntimeError(self.plan_error)
        return self.plans[version]

    def add_plan(self, plan) -> None:
        self.plans[plan.version] = plan

    def report(self, progress) -> None:
        self.calls.append(("report", progress.step))

    def epoch_agreed(self, epoch: int, step: int, *rest: Any) -> None:
        self.calls.append(("epoch_agreed", (epoch, step)))

    def state_received(self, slot: str, epoch: int, source: str, step: int) -> None:
        self.calls.append(("state_received", (slot, source, step)))

    def collective_failed(self, slot: str, epoch: int, error: str) -> None:
        self.calls.append(("collective_failed", slot))

    def fault_fired(self, index: int, slot: str, step: int, phase: str) -> None:
        self.calls.append(("fault_fired", (index, slot, step, phase)))

    def save_checkpoint(self, step: int, blob: bytes) -> None:
        self.calls.append(("save_checkpoint", step))

    def recorded(self) -> list[tuple[str, Any]]:
        return list(self.calls)


@ray.remote(num_cpus=0.5, concurrency_groups={"control": 2})
class CommPeer:
    def __init__(self) -> None:
        self.comm: Optional[BaseCommunicator] = None
        self.handle = None
        self.buffer: Optional[torch.Tensor] = None

    def pid(self) -> int:
        return os.getpid()

    def form(self, spec: GroupSpec) -> float:
        started = time.perf_counter()
        if self.comm is not None:
            self.comm.close()
        self.comm = make_communicator(spec)
        return time.perf_counter() - started

    def all_reduce(self, numel: int, value: float) -> float:
        tensor = torch.full((numel,), value)
        self.comm.all_reduce(tensor).wait()
        return float(tensor[0])

    def start_all_reduce(self, numel: int, die: bool = False) -> float:
        self.buffer = torch.ones(numel)
        self.handle = self.comm.all_reduce(self.buffer)
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        return time.time()

    def wait_pending(self) -> dict:
        try:
            self.handle.wait()
            return {"outcome": "ok", "at": time.time()}
        except CommError as err:
            return {"outcome": type(err).__name__, "at": time.time(), "error": str(err)}

    @ray.method(concurrency_group="control")
    def abort(self, reason: str) -> float:
        self.comm.abort(reason)
        return time.time()
