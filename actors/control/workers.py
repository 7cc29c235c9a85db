"""What the coordinator asks of Ray about its workers and its own process: one seam.

Every call the coordinator makes to a worker actor goes through a `WorkerGroup`: create one, wait
until it is ready, adopt a hot spare, start its run, watch it end, hand it a plan, abort an epoch,
heartbeat and probe it, ask it for records, states and checkpoints, kill it. So do the few cluster
questions it asks (free resources, whether an actor is placed, whether the owning driver is gone)
and the group store workers rendezvous on. `RayWorkerGroup` does all of it with Ray;
`testkit/fake_workers.py`'s `FakeWorkerGroup` does it in-process, one event at a time, so that the
coordinator's whole loop runs in a unit test and at 1,024 members in a benchmark.

A handle is whatever the group returns from `create` or `lookup`; the coordinator never looks inside.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.control.members import describe, first_line, is_placed, job_is_dead, kill, log, log_to
from actors.control.placement import NodePacker, ray_place_of, ray_rooms
from actors.lifeline import watch as lifeline_watch
from actors.messages import Heartbeat, ReadyAnswer, RunOutcome, WorkerStatus
from actors.plan import Plan, WorkerSpec, holder_name
from algorithms.rules.membership import placement_shortfall
from core.schema import JobConfig


class WorkerGroup:
    """The interface; every method is overridden by `RayWorkerGroup` and the fake."""

    node_ip: str = "127.0.0.1"
    reconstructed: bool = False
    """Whether this coordinator process is a restart of one that died (it carries on from the run directory)."""

    def setup(self, run_dir: Path, log_level: str) -> None:
        """This process's logging (an actor's own log file); nothing for a fake."""

    def create(self, name: str, spec: WorkerSpec) -> Any:
        """A new worker (or spare) actor named `name`; blocking (the caller runs it in a thread)."""
        raise NotImplementedError

    def lookup(self, name: str) -> Any:
        """The live actor named `name`, or None."""
        raise NotImplementedError

    # ---- the coordinator's calls to a worker: one typed method per `WorkerActor` method of the same
    # name (actors/training/worker.py; tests/unit/test_worker_port.py keeps the three in step). Three shapes:
    # told (nobody waits: set_plan, abort_epoch, run), asked (the answer is needed; raises what the
    # worker raised, or TimeoutError: ready, adopt, heartbeat, final_state, load_checkpoint), and
    # probed (None when the worker is gone or silent: status, records_after, evaluate_state,
    # probe_heartbeat, which also says why a dead one died).
    def set_plan(self, handle: Any, plan: Plan) -> Any:
        """Hand the worker a plan; returns the call's reference (the publisher watches it for a death)."""
        raise NotImplementedError

    def abort_epoch(self, handle: Any, membership_epoch: int, reason: str) -> None:
        """The worker's collectives of that epoch fail now."""
        raise NotImplementedError

    def run(self, handle: Any) -> None:
        """Start the worker's run (its end is what `watch` returns)."""
        raise NotImplementedError

    async def ready(self, handle: Any, fired_faults: tuple[int, ...]) -> ReadyAnswer:
        """Wait until a new worker has built its workload: its pid, node, node id and store port."""
        raise NotImplementedError

    async def adopt(self, handle: Any, spec: WorkerSpec, fired_faults: tuple[int, ...], timeout: float) -> ReadyAnswer:
        """A hot spare becomes the worker `spec` describes; answers as `ready` does."""
        raise NotImplementedError

    async def heartbeat(self, handle: Any, timeout: float) -> Heartbeat:
        """The worker's phase, how long it has been in it, and its step."""
        raise NotImplementedError

    async def final_state(self, handle: Any, timeout: float) -> bytes:
        """The worker's committed state (the final model)."""
        raise NotImplementedError

    async def load_checkpoint(self, handle: Any, data: bytes, timeout: float | None = None) -> int:
        """Load a checkpoint; answers its step."""
        raise NotImplementedError

    async def probe_heartbeat(self, handle: Any, timeout: float) -> tuple[Heartbeat | None, str | None]:
        """(heartbeat, None); (None, why) when the worker is known dead; (None, None) when it did not answer."""
        raise NotImplementedError

    async def status(self, handle: Any, timeout: float = 5.0) -> WorkerStatus | None:
        """The worker's step, state checksum, plan and whether it holds a state; None if gone or silent."""
        raise NotImplementedError

    async def records_after(self, handle: Any, step: int, timeout: float = 5.0) -> tuple[dict, ...] | None:
        """The history records the worker keeps past `step`; None if gone or silent."""
        raise NotImplementedError

    async def evaluate_state(self, handle: Any, blob: bytes, timeout: float = 5.0) -> dict | None:
        """The evaluation metrics of a state; None if the worker is gone or silent."""
        raise NotImplementedError

    async def watch(self, handle: Any) -> tuple[str, RunOutcome]:
        """Waits until the worker's run ends: ("finished" | "error" | "died", its outcome)."""
        raise NotImplementedError

    def kill(self, handle: Any) -> None:
        raise NotImplementedError

    def release_data(self, job: str, run_id: str) -> None:
        """End the run's Ray Data holder (actors/training/data_holder.py), if it has one."""
        handle = self.lookup(holder_name(job, run_id))
        if handle is not None:
            self.kill(handle)

    def kill_process(self, node: str, pid: int) -> None:
        """SIGKILL a worker's process when it runs on this node (a stopped process cannot answer Ray)."""

    def process_state(self, node: str, pid: int) -> str | None:
        """A worker's process on this node: "running", or "exiting" once its exit has begun; None for
        one elsewhere, or when it cannot be told (`local_process_state`)."""
        return None

    def watch_exit(self, node: str, pid: int, lifeline: dict | None, on_end: Callable[[], None],
                   wanted: Callable[[], bool]) -> bool:
        """Call `on_end()` from another thread as soon as the worker's process on this node begins to end
        (actors/lifeline.py), while `wanted()`; False, with nothing started, for one elsewhere or one
        without a lifeline."""
        return False

    def actor_id(self, handle: Any) -> str:
        return ""

    def is_placed(self, handle: Any) -> bool | None:
        return True

    def free_resources(self) -> dict:
        return {}

    def job_is_dead(self, job_id: str) -> bool:
        return False

    def publish_record(self, name: str, record: dict) -> None:
        """A small record a later `status NAME` finds after the actors are gone."""

    def keep_secret(self, key: str, value: bytes) -> None:
        """A secret a restarted coordinator needs on any node, kept where nothing is mirrored (Ray's KV
        store, token-authenticated); nothing for a fake (its coordinator keeps it in the run folder)."""

    def recall_secret(self, key: str) -> bytes | None:
        return None

    def forget_secrets(self, prefix: str) -> None:
        """Delete the secrets kept under `prefix` (a run's, once it ended for good)."""

    def start_self(self, name: str, namespace: str) -> None:
        """A restarted coordinator asks for its own `start` (nobody else will)."""

    def metric(self, metric: Any, defaults: dict[str, str]) -> Any:
        """A metric to export (actors/observe/metrics.py): Ray's, through its metrics agent; the fake's records values."""
        raise NotImplementedError

    def exit(self) -> None:
        """This coordinator is done: its process goes."""


class PlacementWatch:
    """Whether a worker actor that has no process yet lacks room in the cluster: what a joiner or a spare
    that waits tells the user (an event, `status`), instead of sitting in "starting" with no word."""

    def __init__(self, group: WorkerGroup, cpus: float, gpus: float, grace_s: float) -> None:
        """`cpus`, `gpus`: what one worker asks (`workers.cpus`, `workers.gpus`); `grace_s`: how long an
        actor may go unplaced before it is said (`workers.pause_after_s`, as at the job's start)."""
        self.group, self.cpus, self.gpus, self.grace_s = group, cpus, gpus, grace_s

    async def shortfall(self, handle: Any, waiting: Callable[[], bool]) -> str | None:
        """Once `handle` has had no process for `grace_s` (looked at every `grace_s`) while `waiting()`, and
        the cluster has not free what it asks: that, in words. None once it is placed, no longer waited
        for, or where Ray cannot tell. While it is unplaced with the room free, Ray is placing it."""
        while True:
            await asyncio.sleep(self.grace_s)
            if not waiting():
                return None
            placed = await asyncio.to_thread(self.group.is_placed, handle)
            if placed is not False:
                return None
            free = await asyncio.to_thread(self.group.free_resources)
            short = placement_shortfall(self.cpus, self.gpus, free)
            if short is not None:
                return short

    async def placed(self, handle: Any, waiting: Callable[[], bool]) -> bool:
        """Once `handle` has a process (looked at every `grace_s`): True; False once no longer waited for."""
        while waiting():
            if await asyncio.to_thread(self.group.is_placed, handle) is not False:
                return True
            await asyncio.sleep(self.grace_s)
        return False


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc's malloc asks for transparent huge pages (madvise) for the heap and its mapped chunks."""


def worker_process_env(cfg: JobConfig, inherited: str | None = None) -> dict[str, str]:
    """Variables set in a worker's process at its start (a Ray runtime environment): the lab's shim
    (lab jobs) and, with `workers.huge_pages`, glibc's huge-page tunable, added to any GLIBC_TUNABLES
    already set (`inherited`; the coordinator's own by default)."""
    env: dict[str, str] = {}
    if cfg.network.lab:  # the lab: its connect() shim preloaded (orchestrator/lab.py)
        from actors.transport.lab_shim import worker_env  # only lab jobs need it

        env.update(worker_env(cfg.network))
    if cfg.workers.huge_pages:
        have = os.environ.get("GLIBC_TUNABLES", "") if inherited is None else inherited
        if "glibc.malloc.hugetlb" not in have:  # the user's own setting stands
            env["GLIBC_TUNABLES"] = f"{have}:{HUGE_PAGES_TUNABLE}" if have else HUGE_PAGES_TUNABLE
    return env


class RayWorkerGroup(WorkerGroup):
    def __init__(self, cfg: JobConfig) -> None:
        import ray  # the fake never needs it

        self.cfg = cfg
        self.node_ip = ray.util.get_node_ip_address()
        self.reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        w = cfg.workers
        self.packer = (NodePacker({"CPU": w.cpus, "GPU": w.gpus}, ray_rooms, ray_place_of)
                       if w.placement == "pack" else None)
        """Where each new worker goes under `workers.placement: pack` (actors/control/placement.py)."""

    def setup(self, run_dir: Path, log_level: str) -> None:
        log_to(run_dir / "coordinator.log", log_level)

    def create(self, name: str, spec: WorkerSpec) -> Any:
        import ray

        from actors.training.worker import WorkerActor

        w = self.cfg.workers
        env = worker_process_env(self.cfg)
        if env:  # a child's own env_vars replace its parent's unless merged: keep the coordinator's
            env = {**(ray.get_runtime_context().runtime_env or {}).get("env_vars", {}), **env}

        def create(node: str | None) -> Any:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            strategy: Any = ("SPREAD" if w.placement == "spread" else
                             NodeAffinitySchedulingStrategy(node, soft=True, _spill_on_unavailable=True)
                             if node is not None else "DEFAULT")
            return WorkerActor.options(name=name, namespace=self.cfg.ray.namespace, lifetime="detached",
                                       num_cpus=w.cpus, num_gpus=w.gpus, max_restarts=0, scheduling_strategy=strategy,
                                       **({"runtime_env": {"env_vars": env}} if env else {})).remote(spec)

        return create(None) if self.packer is None else self.packer.place(create, self.actor_id)

    def lookup(self, name: str) -> Any:
        import ray

        try:
            return ray.get_actor(name, namespace=self.cfg.ray.namespace)
        except ValueError:
            return None

    def set_plan(self, handle: Any, plan: Plan) -> Any:
        return handle.set_plan.remote(plan)

    def abort_epoch(self, handle: Any, membership_epoch: int, reason: str) -> None:
        handle.abort_epoch.remote(membership_epoch, reason)

    def run(self, handle: Any) -> None:
        handle.run.remote()

    async def ready(self, handle: Any, fired_faults: tuple[int, ...]) -> ReadyAnswer:
        return await _answer(handle.ready.remote(fired_faults), None)

    async def adopt(self, handle: Any, spec: WorkerSpec, fired_faults: tuple[int, ...], timeout: float) -> ReadyAnswer:
        return await _answer(handle.adopt.remote(spec, fired_faults), timeout)

    async def heartbeat(self, handle: Any, timeout: float) -> Heartbeat:
        return await _answer(handle.heartbeat.remote(), timeout)

    async def final_state(self, handle: Any, timeout: float) -> bytes:
        return await _answer(handle.final_state.remote(), timeout)

    async def load_checkpoint(self, handle: Any, data: bytes, timeout: float | None = None) -> int:
        return await _answer(handle.load_checkpoint.remote(data), timeout)

    async def probe_heartbeat(self, handle: Any, timeout: float) -> tuple[Heartbeat | None, str | None]:
        return await probe_actor("heartbeat", lambda: handle.heartbeat.remote(), timeout)

    async def status(self, handle: Any, timeout: float = 5.0) -> WorkerStatus | None:
        return (await probe_actor("status", lambda: handle.status.remote(), timeout))[0]

    async def records_after(self, handle: Any, step: int, timeout: float = 5.0) -> tuple[dict, ...] | None:
        return (await probe_actor("records_after", lambda: handle.records_after.remote(step), timeout))[0]

    async def evaluate_state(self, handle: Any, blob: bytes, timeout: float = 5.0) -> dict | None:
        return (await probe_actor("evaluate_state", lambda: handle.evaluate_state.remote(blob), timeout))[0]

    async def watch(self, handle: Any) -> tuple[str, RunOutcome]:
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            outcome: RunOutcome = await handle.watch.remote()
            return ("finished" if outcome.ok else "error"), outcome
        except (ActorDiedError, RayActorError) as err:
            return "died", RunOutcome(False, error=describe(err))
        except Exception as err:  # noqa: BLE001
            return "error", RunOutcome(False, error=describe(err), traceback=traceback.format_exc())

    def kill(self, handle: Any) -> None:
        kill(handle)

    def kill_process(self, node: str, pid: int) -> None:
        if node == self.node_ip and pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as err:
                log.debug("SIGKILL of pid %s: %s", pid, err)

    def process_state(self, node: str, pid: int) -> str | None:
        return local_process_state(pid) if node == self.node_ip and pid else None

    def watch_exit(self, node: str, pid: int, lifeline: dict | None, on_end: Callable[[], None],
                   wanted: Callable[[], bool]) -> bool:
        if node != self.node_ip or not pid or not lifeline:
            return False
        return lifeline_watch(pid, lifeline, on_end, wanted, name=f"lifeline-{pid}") is not None

    def actor_id(self, handle: Any) -> str:
        return handle._actor_id.hex() if handle is not None else ""

    def is_placed(self, handle: Any) -> bool | None:
        return is_placed(handle)

    def free_resources(self) -> dict:
        import ray

        return ray.available_resources()

    def job_is_dead(self, job_id: str) -> bool:
        return job_is_dead(job_id)

    def publish_record(self, name: str, record: dict) -> None:
        from actors.runs import runfiles

        runfiles.publish_record(name, record)

    def keep_secret(self, key: str, value: bytes) -> None:
        from actors.runs import runfiles

        runfiles.keep_secret(key, value)

    def recall_secret(self, key: str) -> bytes | None:
        from actors.runs import runfiles

        return runfiles.recall_secret(key)

    def forget_secrets(self, prefix: str) -> None:
        from actors.runs import runfiles

        runfiles.forget_secrets(prefix)

    def start_self(self, name: str, namespace: str) -> None:
        start_self_when_alive(name, namespace)

    def metric(self, metric: Any, defaults: dict[str, str]) -> Any:
        from actors.observe.metrics import ray_metric

        return ray_metric(metric, defaults)

    def exit(self) -> None:
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


PF_EXITING = 0x4
"""The kernel's flag for a task in its exit (include/linux/sched.h), in /proc/<pid>/stat's ninth field."""


def local_process_state(pid: int, proc: Path = Path("/proc")) -> str | None:
    """"exiting" once process `pid` of this machine has begun to exit (a SIGKILL, a crash, an OOM kill),
    "running" before, None where it cannot be told: no /proc (not Linux), or no such pid (reaped already,
    when Ray's notice is due anyway, or in another PID namespace: a container). The kernel flags a task
    PF_EXITING as its exit begins, and closes its sockets only after it has freed its memory: tens of
    milliseconds later for a worker (benchmarks/kill_floor.py), which is when its peers and Ray hear of
    the death."""
    if not (proc / "self" / "stat").exists():
        return None
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ..., flags (the 7th)
    return "exiting" if fields[0] in ("Z", "X") or int(fields[6]) & PF_EXITING else "running"


async def _answer(ref: Any, timeout: float | None) -> Any:
    """A Ray call's answer on this event loop, within `timeout` (None: no limit)."""
    future = asyncio.wrap_future(ref.future())
    return await (asyncio.wait_for(future, timeout) if timeout is not None else future)


async def probe_actor(what: str, call: Callable[[], Any], timeout: float) -> tuple[Any | None, str | None]:
    """A control call that tells a dead actor apart from a silent one: (answer, None); (None, why)
    when Ray says the actor died; (None, None) when it did not answer in time, or answered with an error."""
    from ray.exceptions import ActorDiedError

    try:
        return await asyncio.wait_for(asyncio.wrap_future(call().future()), timeout), None
    except ActorDiedError as err:
        return None, describe(err)
    except Exception as err:  # noqa: BLE001 - not answering (hung, or on a lost node), or a failed call
        log.debug("control call %s to a worker got no answer: %s", what, describe(err))
        return None, None


SELF_CALL_DEADLINE_S = 60.0
"""A restarted coordinator whose own `start` is not taken within this long kills itself (Ray restarts it)."""


def start_self_when_alive(name: str, namespace: str, deadline_s: float = SELF_CALL_DEADLINE_S,
                          call: Callable[[], Any] | None = None,
                          give_up: Callable[[], None] | None = None) -> threading.Thread:
    """Call this restarted coordinator's own `start` once it accepts calls, from a thread of its own.

    A call an actor sends itself from `__init__` during a restart can reach Ray's submitter while
    the actor is still RESTARTING; Ray then fails it ("the actor is restarting") and does not retry
    it, and a coordinator whose `start` is lost never runs (seen in CI as a job that hung after a
    coordinator restart). So the call is made again until it returns (`start` is idempotent). Past
    `deadline_s`, `give_up` runs: by default the process kills itself, Ray restarts it, and the next
    incarnation tries again. `call` replaces the Ray call (tests)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    def ray_call() -> Any:
        return ray.get(ray.get_actor(name, namespace=namespace).start.remote(), timeout=30)

    def kill_self() -> None:
        log.error("%s.start was not taken within %.0fs: this incarnation exits and Ray restarts it", name, deadline_s)
        os.kill(os.getpid(), signal.SIGKILL)

    def run() -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                (call or ray_call)()
                return
            except (RayActorError, GetTimeoutError, ValueError) as err:  # not accepting calls yet
                log.warning("%s.start not taken yet (%s); asking again", name, first_line(err))
                time.sleep(0.2)
        (give_up or kill_self)()

    thread = threading.Thread(target=run, name="start-self", daemon=True)
    thread.start()
    return thread
