"""Ray actors that stand in for parts of a job under test: `StoreHost` hosts a group's store,
`FakeCoordinator` records every call a worker actor makes and serves it plans, and `CommPeer` hosts one
communicator per membership epoch in a long-lived process, so tests can re-form groups in the same
processes, kill or freeze a peer while its all-reduce is in flight, and abort an epoch from a control
thread, exactly as the worker does."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Protocol, runtime_checkable

import ray
import torch

from actors.transport.comm import BaseCommunicator, CommError, GroupSpec, make_communicator, serve_store


class Waitable(Protocol):
    def wait(self) -> None: ...


@runtime_checkable
class PeerGroup(Protocol):
    """What `CommPeer` uses of its group: the gloo and the NCCL communicator both have it."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Waitable: ...
    def abort(self, reason: str = "aborted by coordinator") -> None: ...
    def close(self) -> None: ...


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
        self.plan_error: str | None = None

    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def fail_get_plan(self, message: str | None) -> None:
        self.plan_error = message

    def get_plan(self, version: int):
        self.calls.append(("get_plan", version))
        if self.plan_error:
            raise RuntimeError(self.plan_error)
        return self.plans[version]

    def add_plan(self, plan) -> None:
        self.plans[plan.version] = plan

    def report(self, progress, order=None) -> None:
        self.calls.append(("report", progress.step))

    def epoch_agreed(self, epoch: int, step: int, *rest: Any, order=None) -> None:
        self.calls.append(("epoch_agreed", (epoch, step)))

    def state_received(self, slot: str, epoch: int, source: str, step: int, order=None) -> None:
        self.calls.append(("state_received", (slot, source, step)))

    def collective_failed(self, slot: str, epoch: int, error: str, order=None) -> None:
        self.calls.append(("collective_failed", slot))

    def fault_fired(self, index: int, slot: str, step: int, phase: str, order=None) -> None:
        self.calls.append(("fault_fired", (index, slot, step, phase)))

    def samples_skipped(self, slot: str, step: int, ids: list, reason: str, order=None) -> None:
        self.calls.append(("samples_skipped", (slot, step, ids)))

    def transport_fallback(self, slot: str, epoch: int, group: str, reason: str, order=None) -> None:
        self.calls.append(("transport_fallback", (slot, group)))

    def save_checkpoint(self, step: int, blob: bytes, order=None) -> None:
        self.calls.append(("save_checkpoint", step))

    def recorded(self) -> list[tuple[str, Any]]:
        return list(self.calls)


# Ray's stubs leave out `concurrency_groups`, which ray.remote takes for an actor class
@ray.remote(num_cpus=0.5, concurrency_groups={"control": 2})  # type: ignore[call-overload]
class CommPeer:
    def __init__(self) -> None:
        self.comm: PeerGroup | None = None
        self.handle: Waitable | None = None
        self.buffer: torch.Tensor | None = None

    def _group(self) -> PeerGroup:
        if self.comm is None:
            raise RuntimeError("no group: call form() first")
        return self.comm

    def pid(self) -> int:
        return os.getpid()

    def form(self, spec: GroupSpec) -> float:
        started = time.perf_counter()
        if self.comm is not None:
            self.comm.close()
        comm = make_communicator(spec)
        if not isinstance(comm, PeerGroup):
            raise TypeError(f"{type(comm).__name__} cannot all-reduce or close")
        self.comm = comm
        return time.perf_counter() - started

    def all_reduce(self, numel: int, value: float) -> float:
        tensor = torch.full((numel,), value)
        self._group().all_reduce(tensor).wait()
        return float(tensor[0])

    def start_all_reduce(self, numel: int, die: bool = False, via_ray: bool = False, device: str = "cpu") -> float:
        """Launch an all-reduce of ones; `via_ray`: through `ray.util.collective.allreduce` on the
        group published as a workload would see it (run in a thread; `wait_pending` waits for it)."""
        self.buffer = buffer = torch.ones(numel, device=device)
        if via_ray:
            import ray.util.collective as col

            from actors.transport import collective

            comm = self._group()
            if not isinstance(comm, BaseCommunicator):
                raise TypeError(f"{type(comm).__name__} is not a communicator")
            collective.publish(comm, "bsp")
            name, done = collective.current_group(), threading.Event()

            class Pending:
                def wait(self) -> None:
                    done.wait()
                    if "error" in outcome:
                        raise outcome["error"]

            def call() -> None:
                try:
                    col.allreduce(buffer, group_name=name)
                except CommError as err:
                    outcome["error"] = err
                finally:
                    done.set()

            outcome: dict = {}
            threading.Thread(target=call, daemon=True).start()
            self.handle = Pending()
        else:
            self.handle = self._group().all_reduce(buffer)
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        return time.time()

    def wait_pending(self) -> dict:
        if self.handle is None or self.buffer is None:
            raise RuntimeError("no all-reduce pending: call start_all_reduce() first")
        try:
            self.handle.wait()
            return {"outcome": "ok", "at": time.time(), "value": float(self.buffer[0])}
        except CommError as err:
            return {"outcome": type(err).__name__, "at": time.time(), "error": str(err)}

    @ray.method(concurrency_group="control")
    def abort(self, reason: str) -> float:
        self._group().abort(reason)
        return time.time()
