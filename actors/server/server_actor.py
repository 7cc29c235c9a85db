"""The parameter server's Ray actor, without torch: the coordinator creates it and finds it by name.

`ParameterServer` is the actor around a `ServerHost` (actors/server/server_host.py; the background kind's
`DispenserHost`, actors/server/dispenser_host.py, is one): detached and named
`<job>/<run id>/server` like the workers (a coordinator crash does not take it down), threaded,
restarted by Ray when its process dies. The host, and torch with it, is imported in the server's own
process when the actor starts, so that a server kind's coordinator (whose members form no group, so
it serves no group store either) never loads torch: about 1.4 s of CPU and a few hundred MiB.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import ray

from actors import REMOTE_HOME
from actors.plan import server_name
from actors.runs import credentials, runfiles

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from actors.server.dispenser_host import DispenserHost
    from algorithms.policies.server_messages import Fence, Pull, PushResult
    from core.schema import JobConfig

MAX_RESTARTS = 5
"""How many times Ray restarts a server process that died (each restart resumes from a snapshot)."""


class CoordinatorReports:
    """The server's reports to its coordinator, found by name (it may have been restarted)."""

    def __init__(self, coordinator: str, namespace: str) -> None:
        self.coordinator, self.namespace = coordinator, namespace
        self._handle = None

    def _coord(self):
        if self._handle is None:  # a restarted coordinator keeps its actor id: the handle stays good
            self._handle = ray.get_actor(self.coordinator, namespace=self.namespace)
        return self._handle

    def records(self, records: tuple[dict, ...], summary: dict) -> None:
        try:
            self._coord().server_report.remote(records, summary)
        except Exception:
            self._handle = None  # looked up again next time; these records wait in `kept`
            raise

    def restarted(self, resumed_version: int, incarnation: int, snapshot: str | None) -> None:
        self._coord().server_restarted.remote(resumed_version, incarnation, snapshot)

    def barrier(self, index: int, members: tuple[str, ...], intervals: dict[str, list[float]]) -> None:
        try:
            self._coord().server_barrier.remote(index, members, intervals)
        except Exception:
            self._handle = None
            raise


class ParameterServer:
    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there
    """The Ray actor: a `ServerHost` in a detached, threaded, restartable process."""

    def __init__(self, config: dict, run_dir: str, coordinator: str, namespace: str) -> None:
        from actors.server.parameter_server import make_host  # torch: in the server's process only
        from actors.training.worker import _redirect_output

        _redirect_output(os.path.join(run_dir, "workers", "server.log"))
        logging.basicConfig(level=config.get("log_level", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        credentials.receive(runfiles.recall_secret(credentials.kv_key(coordinator, os.path.basename(run_dir))))
        self.host = make_host(config, run_dir, CoordinatorReports(coordinator, namespace), restarted=restarted)

    def _dispenser(self) -> DispenserHost:
        from actors.server.dispenser_host import as_dispenser  # torch: in the server's process only

        return as_dispenser(self.host)

    def ready(self) -> dict:
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), **self.host.summary()}

    def set_members(self, epoch: int, members: list[tuple[str, int]]) -> None:
        self.host.set_members(epoch, members)

    def pull(self, fence: Fence, wait_s: float) -> tuple[Pull, np.ndarray | None]:
        return self.host.pull(fence, wait_s)

    def push(self, fence: Fence, lease_ids: tuple[int, ...], pulled_version: int, grad: np.ndarray, loss: float,
             buffers: np.ndarray | None = None) -> PushResult:
        return self.host.push(fence, lease_ids, pulled_version, grad, loss, buffers)

    def close(self, reason: str, wait_s: float) -> None:
        self.host.close(reason, wait_s)

    def summary(self) -> dict:
        return self.host.summary()

    def model_state(self) -> bytes:
        return self.host.model_state()

    def records_after(self, step: int) -> tuple[dict, ...]:
        return self.host.records_after(step)

    def load_checkpoint(self, blob: bytes) -> int:
        return self.host.load_checkpoint(blob)

    def push_pull(self, fence: Fence, lease_ids: tuple[int, ...], pulled_version: int, grad: np.ndarray, loss: float,
                  wait_s: float, buffers: np.ndarray | None = None) -> tuple[PushResult, Pull | None, np.ndarray | None]:
        return self.host.push_pull(fence, lease_ids, pulled_version, grad, loss, wait_s, buffers)

    def set_schedule(self, index: int, iterations: dict[str, int]) -> bool:
        return self.host.set_schedule(index, iterations)

    def lease_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple]:
        return self._dispenser().lease_block(fence, count, size)

    def applied(self, fence: Fence, keys: list[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> int:
        return self._dispenser().applied(fence, keys, rounds, final, upto, finished)

    def elastic(self, fence: Fence, x: np.ndarray, alpha: float) -> tuple[str | None, np.ndarray | None]:
        return self._dispenser().elastic(fence, x, alpha)


# Pulls wait at the server (up to PULL_WAIT_S each): one thread per worker and a few for control.
# Ray's typed overloads of ray.remote list task options only; max_concurrency is an actor option it takes.
ParameterServerActor = ray.remote(max_concurrency=32)(ParameterServer)  # type: ignore[call-overload]


def start_server(cfg: JobConfig, config: dict, run_id: str, run_dir: str, namespace: str) -> Any:
    """Create the detached server actor of a job run (before its workers); returns its handle."""
    return ParameterServerActor.options(
        name=server_name(cfg.name, run_id), namespace=namespace, lifetime="detached", num_cpus=cfg.server.cpus,
        max_restarts=MAX_RESTARTS,
    ).remote(config, run_dir, cfg.name, namespace)


def find_server(job: str, run_id: str, namespace: str) -> Any:
    try:
        return ray.get_actor(server_name(job, run_id), namespace=namespace)
    except ValueError:
        return None
