"""The worker actor: a `Replica` (actors/training/replica.py) in a detached Ray actor process.

A hot spare (`workers.spares`; its spec's slot is `spare<k>`) starts the same way but builds only
the workload, and holds no replica until `adopt(spec)` makes it the worker of a slot.

`run()` is called exactly once and trains until the plan says stop; control methods (`set_plan`,
`abort_epoch`, `status`, `final_state`, ...) run in their own concurrency group so they answer while
`run()` trains, and `watch()` in a third so it never starves them. `watch()` returns when `run()`
ends and raises `ActorDiedError` in the caller when the process dies, so any coordinator
incarnation can supervise a worker it did not start. Worker output goes to the run directory, and
a worker whose raylet is gone exits at once (`ParentWatch`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from actors import REMOTE_HOME
from actors.lifeline import Lifeline
from actors.messages import Heartbeat, ReadyAnswer, RunOutcome, WorkerStatus
from actors.observe.metrics import Exporter
from actors.plan import ParentWatch, Plan, Progress, WorkerSpec, server_name
from actors.training.user_code import WorkloadBug
from algorithms.rules.supervision import WorkloadFault
from core.schema import JobConfig, parse

if TYPE_CHECKING:  # pragma: no cover
    from actors.training.replica import Replica

# This module imports no torch: the coordinator imports it for the actor class, and its process
# starts workers sooner without torch's two seconds of import (actors/transport/store.py). The worker's
# process imports the training side (actors/training/replica.py, torch) in `__init__`.


class RayLink:
    """The replica's `Link` to its coordinator actor, found by name (it may have been restarted). Every
    message is numbered, so that the coordinator runs them in the order sent (actors/control/sequencer.py)."""

    def __init__(self, spec: WorkerSpec, coordinator: Any = None) -> None:
        self.spec = spec
        self._handle = coordinator
        self._sender = f"{spec.slot}/{uuid.uuid4().hex[:12]}"
        self._next = 0
        self._lock = threading.Lock()
        self._checkpoints: list = []
        """The checkpoints sent whose storing has not been seen to end (ObjectRefs of the calls)."""
        config = parse(JobConfig, spec.config)
        self._metrics = Exporter(spec.job, spec.run_id, config.sync.policy,
                                 enabled=config.tracking.metrics and config.tracking.per_worker_metrics)
        self._coord()  # found now, not at the first report: that lookup took 0.1-0.45 s here, after step 1

    def _coord(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.spec.coordinator, namespace=self.spec.namespace)
        return self._handle

    def _send(self, call: Callable[[Any, tuple[str, int]], ray.ObjectRef]) -> ray.ObjectRef:
        """`call(coordinator, order)`: one of the coordinator's methods, called with this link's next
        number (the coordinator takes each sender's calls in that order: actors/control/sequencer.py)."""
        with self._lock:  # numbers in the order submitted; a call that could not be sent uses no number
            ref = call(self._coord(), (self._sender, self._next))
            self._next += 1
            return ref

    def report(self, progress: Progress, wait: bool) -> None:
        ref = self._send(lambda c, order: c.report.remote(progress, order=order))
        for seconds in progress.step_s:  # at a report (a batch of steps), never inside a step
            self._metrics.observe("worker_step_compute_seconds", seconds, slot=progress.slot)
        if wait:
            ray.get(ref, timeout=10)

    def epoch_agreed(self, epoch: int, step: int, records: tuple[dict, ...]) -> None:
        self._send(lambda c, order: c.epoch_agreed.remote(epoch, step, records, order=order))

    def state_received(self, slot: str, epoch: int, source: str, step: int) -> None:
        self._send(lambda c, order: c.state_received.remote(slot, epoch, source, step, order=order))

    def collective_failed(self, slot: str, epoch: int, error: str) -> None:
        self._send(lambda c, order: c.collective_failed.remote(slot, epoch, error, order=order))

    def fault_fired(self, index: int, slot: str, step: int, phase: str) -> None:
        ray.get(self._send(lambda c, order: c.fault_fired.remote(index, slot, step, phase, order=order)), timeout=5)

    def samples_skipped(self, slot: str, step: int, ids: list[int], reason: str) -> None:
        self._send(lambda c, order: c.samples_skipped.remote(slot, step, ids, reason, order=order))

    def transport_fallback(self, slot: str, epoch: int, group: str, reason: str) -> None:
        self._send(lambda c, order: c.transport_fallback.remote(slot, epoch, group, reason, order=order))

    def save_checkpoint(self, step: int, blob: bytes) -> None:
        if self._checkpoints:  # forget those already stored
            self._checkpoints = ray.wait(self._checkpoints, num_returns=len(self._checkpoints), timeout=0)[1]
        self._checkpoints.append(self._send(lambda c, order: c.save_checkpoint.remote(step, blob, order=order)))  # answered once stored

    def checkpoints_stored(self, timeout: float) -> None:
        pending, self._checkpoints = self._checkpoints, []
        ray.get(pending, timeout=timeout)


class Worker:
    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there
    """The Ray actor: `run()` once in the default group, control methods in their own group."""

    def __init__(self, spec: WorkerSpec) -> None:
        self._lifeline = Lifeline.hold()  # first: a death from here on is seen at once on this node
        self._parent = ParentWatch()
        self.spec = spec
        _redirect_output(os.path.join(spec.run_dir, "workers", f"{spec.slot}.log"))
        logging.basicConfig(level=spec.config.get("log_level", "WARNING"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        for path in spec.search_path:
            if os.path.isdir(path) and path not in sys.path:
                sys.path.insert(0, path)
        os.environ["ORCHESTRATOR_SLOT"] = spec.slot  # user code may read which slot it runs in ("spare<k>")
        self._host = HostedStore(ray.util.get_node_ip_address(), float(spec.config.get("comm", {}).get("timeout_s", 10.0)))
        self.replica: Replica | None = None
        self._workload = None
        self._coordinator = None
        self._fault: WorkloadFault | None = None
        """The workload's factory raised: `ready` raises it, so that the coordinator learns of it typed (a
        constructor that raised would reach it only as the text of a dead actor's creation task)."""
        try:
            if is_spare(spec.slot):  # the slow part of a start, done ahead: the workload and first-use imports
                self._workload = prepare_spare(parse(JobConfig, spec.config))
                self._coordinator = ray.get_actor(spec.coordinator, namespace=spec.namespace)  # ahead, as the workload
            else:
                self._become(spec)
        except WorkloadBug as bug:
            self._fault = bug.fault
            sys.stderr.write(f"the workload's factory failed: {bug.fault.line}\n{bug.fault.traceback}")

    def _become(self, spec: WorkerSpec, workload=None) -> None:
        from actors.server.server_client import RayServerClient  # see the imports
        from actors.training.replica import Replica

        os.environ["ORCHESTRATOR_SLOT"] = spec.slot
        self.spec = spec
        self.replica = Replica(spec, RayLink(spec, self._coordinator), ray.util.get_node_ip_address(), tick=self._parent.exit_if_orphaned,
                               kill_actor=lambda: ray.kill(ray.get_runtime_context().current_actor, no_restart=True),
                               server=RayServerClient(server_name(spec.job, spec.run_id), spec.namespace),
                               workload=workload, exit_if_stuck=_exit_stuck)

    def _replica(self) -> Replica:
        """The replica, which a hot spare holds only once adopted."""
        if self.replica is None:
            raise AttributeError(f"{self.spec.slot} is a hot spare: it holds no replica until adopted")
        return self.replica

    def run(self) -> RunOutcome:
        return self._replica().run()

    @ray.method(concurrency_group="watch")
    def watch(self) -> RunOutcome:
        return self._replica().watch()

    @ray.method(concurrency_group="control")
    def ready(self, fired_faults: tuple[int, ...] = ()) -> ReadyAnswer:
        return self._answer(fired_faults)

    def _answer(self, fired_faults: tuple[int, ...]) -> ReadyAnswer:
        if self._fault is not None:
            raise WorkloadBug(self._fault)
        node_id = ray.get_runtime_context().get_node_id()
        lifeline = self._lifeline.info() if self._lifeline is not None else None
        if self.replica is None:  # a spare
            return ReadyAnswer(self.spec.slot, os.getpid(), ray.util.get_node_ip_address(), node_id, self._host.port,
                               lifeline)
        return dataclasses.replace(self.replica.ready(fired_faults), node_id=node_id, store_port=self._host.port,
                                   lifeline=lifeline)

    @ray.method(concurrency_group="control")
    def adopt(self, spec: WorkerSpec, fired_faults: tuple[int, ...] = ()) -> ReadyAnswer:
        """A hot spare becomes the worker of `spec.slot` (its replica built on the workload it holds);
        its output goes to that slot's log from here on. Answers as `ready` does."""
        if self.replica is not None:
            raise RuntimeError(f"{self.spec.slot} is already the worker of a slot")
        _redirect_output(os.path.join(spec.run_dir, "workers", f"{spec.slot}.log"))
        workload, self._workload = self._workload, None
        self._become(spec, workload)
        return self._answer(fired_faults)

    @ray.method(concurrency_group="control")
    def set_plan(self, plan: Plan) -> None:
        self._host.hosts(plan)
        self._replica().set_plan(plan)

    @ray.method(concurrency_group="control")
    def abort_epoch(self, membership_epoch: int, reason: str) -> None:
        self._replica().abort_epoch(membership_epoch, reason)

    @ray.method(concurrency_group="control")
    def status(self) -> WorkerStatus:
        return dataclasses.replace(self._replica().status(), store_port=self._host.port)

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> Heartbeat:
        return self._replica().heartbeat()

    @ray.method(concurrency_group="control")
    def load_checkpoint(self, data: bytes) -> int:
        return self._replica().load_checkpoint(data)

    @ray.method(concurrency_group="control")
    def final_state(self) -> bytes:
        return self._replica().final_state()

    @ray.method(concurrency_group="control")
    def evaluate_state(self, blob: bytes) -> dict:
        return self._replica().evaluate_state(blob)

    @ray.method(concurrency_group="control")
    def records_after(self, step: int) -> tuple[dict, ...]:
        return self._replica().records_after(step)


def _exit_stuck(why: str) -> None:
    """A step that outlived its group's abort (`actors.training.replica.watch_release`): this process ends, and the
    coordinator takes it for a death (re-forms without it, or ends a fail-fast job)."""
    logging.getLogger(__name__).error("exiting: %s", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(STUCK_EXIT_CODE)


STUCK_EXIT_CODE = 75
"""The exit status of a worker whose step outlived its group's abort."""


class HostedStore:
    """The group store this worker serves (a TCPStore server on its node's address, from a thread of
    this process): a membership epoch rendezvous on its rank 0's store, as torch's own groups do, so
    the coordinator needs no store (nor torch). A rank 0 that dies takes only its epoch's store with
    it, and that epoch is being replaced. Each epoch this worker hosts enters `EpochKeys`, which drops
    the keys of the ones it hosted before the previous."""

    def __init__(self, host: str, timeout_s: float) -> None:
        from actors.transport.store import EpochKeys, serve_store  # torch.distributed

        self.host = host
        self.store, self.port, self._sock = serve_store(host, timeout_s)
        self._keys, self._epoch = EpochKeys(self.store), -1

    def hosts(self, plan: Plan) -> None:
        """Called with each plan: if it names this store, a new epoch's entry drops older keys."""
        if (plan.store_host, plan.store_port) == (self.host, self.port) and plan.membership_epoch != self._epoch:
            self._epoch = plan.membership_epoch
            self._keys.entered(plan.group_name, len(plan.members), plan.backend)


def is_spare(slot: str) -> bool:
    return slot.startswith("spare")


def prepare_spare(config: JobConfig) -> Any:
    """What a hot spare pays ahead of its adoption (see the imports): its workload, the first-use imports
    of a replica's construction (the optimizer's, the policy's), every module `_become` imports, and
    ray.util.collective (the first epoch publishes its group there). An adoption that imported
    `actors.server.server_client` and the modules it brings took 0.14-0.18 s of a join here, where Python
    caches no bytecode for the project and compiles each module from source; the first epoch's import
    of ray.util.collective took 0.13 s more. With `training.compile`, the model's compilation too."""
    import actors.server.server_client
    import actors.training.replica  # noqa: F401 - `_become`'s import, paid ahead
    from actors.training.workload import build_workload, device_for, warm_up
    from actors.transport import collective

    workload = build_workload(config)
    warm_up(config, workload, device_for(config.workers.gpus))
    collective.prepare()
    return workload


def _redirect_output(path: str) -> None:
    """Worker output (and user prints) goes to the run directory, not the user's screen."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


# Every coordinator incarnation keeps one watch() pending: the dead one's stays until run() ends.
# Ray's typed overloads of ray.remote list task options only; concurrency_groups is an actor option it takes.
WorkerActor = ray.remote(concurrency_groups={"control": 4, "watch": 8})(Worker)  # type: ignore[call-overload]
