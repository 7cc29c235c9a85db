"""Fakes and harnesses for tests.

Without Ray (policy oracles in milliseconds):
- `local_group(n)` forms n members of one gloo group in threads of this process, over a
  `HashStore` (no TCP store, no actors);
- `LocalJob` runs real `Replica`s (the worker's step loop) in threads, with a recording `LocalLink`
  for their coordinator and plans the test publishes itself;
- `LoopbackComm` is a world-size-1 communicator that only records calls.

With Ray: `CommPeer` hosts one communicator per membership epoch in a long-lived actor process, so
tests can re-form groups in the same processes, kill or freeze a peer while its all-reduce is in
flight, and abort an epoch from a control thread, exactly as the worker does; `FakeCoordinator`
stands in for the coordinator of worker actors under test.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from actors.comm import BaseCommunicator, CommError, GroupSpec, make_communicator, serve_store
from actors.comm import in_process_group as local_group  # noqa: F401 - tests import them here
from actors.comm import in_process_store as local_store
from actors.plan import Plan, Progress, WorkerSpec
from algorithms.base import VoteDraft

PACE_S = 0.02
"""What `paced` gives each step of a test job at least: some five times a digits step's compute here."""


def paced(cfg: dict, delay_s: float = PACE_S) -> dict:
    """`cfg` (a plain config dict) with every slot's steps taking at least `delay_s` (a modelled compute
    time: `faults.stragglers` on every slot, which combine with the config's own by the largest delay).
    A job that trains until the test has seen what it waits for then leaves the cores to the tests
    beside it, instead of burning them on steps nobody looks at; numbers are unchanged (a sleep)."""
    workers = cfg.get("workers", {})
    slots = workers.get("max") or workers.get("count", 1)
    faults = dict(cfg.get("faults", {}))
    faults["stragglers"] = list(faults.get("stragglers", [])) + [{"slot": f"w{i}", "delay_s": delay_s}
                                                                 for i in range(slots)]
    return {**cfg, "faults": faults}


def child_env(repo, **over: str) -> dict:
    """The environment for a `python -m orchestrator ...` child process: the repository first on
    PYTHONPATH, ahead of what is already there (where Ray may live, as on the GPU machine)."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo)] + ([path] if path else [])), **over)


QUIET_PORTS_FROM = 20000
"""`free_port` draws from here up to the kernel's ephemeral range: above Ray's worker ports (10002 to
19999 by default), and below the range every bind(0) and outgoing connection takes its port from."""


def free_port() -> int:
    """A TCP port free on this machine now, for a server a test starts. Drawn at random below the
    kernel's ephemeral range, where nothing takes a port unasked: a port from that range (bind(0)) was
    free when drawn but could be taken before a slow server bound it, by any connection of the tests
    beside it (a head node's agents bind theirs tens of seconds after `ray start`, and when one cannot,
    `ray start --block` takes the whole head down)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    draw = random.SystemRandom()  # not the tests' seeded `random`: each process draws its own
    for _ in range(1000):
        port = draw.randrange(QUIET_PORTS_FROM, max(ephemeral, QUIET_PORTS_FROM + 1))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {QUIET_PORTS_FROM}..{ephemeral - 1}")


def assert_batchnorm_trained(model: torch.nn.Module, label: str) -> None:
    """`digits:bn_mlp`'s final model carries its BatchNorm statistics (not their initial values) and
    evaluates well in eval mode, which depends on them."""
    from orchestrator.workloads.digits import accuracy, bn_mlp

    bn = model[1]
    tracked = int(bn.num_batches_tracked)
    moved = float(bn.running_mean.abs().max())
    acc = accuracy(model, bn_mlp().eval_data)["accuracy"]
    print(f"{label}: num_batches_tracked {tracked}, max |running_mean| {moved:.3f}, eval-mode accuracy {acc:.3f}")
    assert tracked > 0 and moved > 0.0, "the final model's BatchNorm statistics are their initial values"
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    assert acc > 0.6


def committed_samples(run_dir: Path, history: list[dict]) -> dict[int, list[int]]:
    """Each committed step's sample ids, over every member's ledger (`faults.record_samples`) in
    `run_dir`, for the steps of `history`: a line counts when its membership epoch is the one history
    committed the step in (a step applied only by departed members was redone later)."""
    committed_in = {r["step"]: r["membership_epoch"] for r in history}
    per_step: dict[int, list[int]] = {}
    for path in (Path(run_dir) / "samples").glob("*.txt"):
        for line in path.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            if committed_in.get(step) == epoch:
                per_step.setdefault(step, []).extend(ids)
    return per_step


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


RAY_START_TIMED_OUT = "The current node timed out during startup"
"""What `ray.init` raises when its raylet did not register within the 30 s Ray allows (ray/_private/node.py)."""


def explain(job: Any, since: float | None = None, lines: int = 15) -> str:
    """What a job was doing, for a test that gave up on it: its state, its events (from `since`, a
    time.time(), on; all if None), and the tail of its coordinator's and each worker's (and the
    server's) log. `job` is an `ElasticJob` (anything with status() and events())."""
    status = job.status()
    origin = since or 0.0  # times relative to `since`; absolute without it
    out = [f"state {status.state} at step {status.step}, epoch {status.membership_epoch}, cause {status.cause!r}; "
           f"members {[(m.slot, m.state, m.pid) for m in status.members]}; server {status.server}"]
    for e in job.events():
        if e["time"] >= origin - 1.0:
            detail = {k: v for k, v in (e.get("detail") or {}).items() if k in ("slot", "detector", "seen_at", "step")}
            out.append(f"{e['time'] - origin:+10.3f} {e['kind']} {e.get('state_to') or ''}: "
                       f"{e.get('reason', '')[:200]} {detail or ''}")
    run_dir = Path(status.run_dir)
    for log in [run_dir / "coordinator.log"] + sorted((run_dir / "workers").glob("*.log")):
        if log.exists():
            out += [f"--- {log.name}"] + log.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(out)


def wait_for_end(job: Any, timeout: float, since: float | None = None) -> Any:
    """`job.wait(timeout)`, failing with `explain` (what the job was doing) when it does not end in time."""
    try:
        return job.wait(timeout=timeout)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{explain(job, since)}") from None


def start_run(args: list[str], cwd: Path, env: dict, output: Path, tries: int = 2) -> Any:
    """`python -m orchestrator run ARGS` in a session of its own (it starts its own local Ray), its
    output appended to `output`; returned once it printed its job line (Ray is up) or ended. Ray's own
    start can time out on a loaded machine (two clean-clone CI runs saw a run exit 1 with
    RAY_START_TIMED_OUT before its first step): such a run's process group is killed and it starts
    again, at most `tries` times in all."""
    import subprocess
    import sys

    for attempt in range(tries):
        offset = output.stat().st_size if output.exists() else 0
        with open(output, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", *args], cwd=cwd, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def said() -> str:
            with open(output, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and \
                not any(line.startswith("job ") for line in said().splitlines()):
            time.sleep(0.05)
        if proc.poll() is None or RAY_START_TIMED_OUT not in said() or attempt == tries - 1:
            return proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the failed start left running
        except OSError:
            pass
    return proc


def sigkill_run_at(proc: Any, newest_step: Callable[[], int], at: int, timeout: float = 120,
                   output: Path | None = None) -> None:
    """SIGKILL the process group of `proc` (a `run` started with `start_new_session=True`) once
    `newest_step()` reaches `at`, and wait until every process of it is gone (Ray's own exit once
    their parent has). `output`: the file the run writes its output to, whose end a failure shows."""
    import psutil

    def said() -> str:
        text = output.read_text(errors="replace") if output is not None and output.exists() else ""
        return f"; its output ends:\n{text[-3000:]}" if text else ""

    group = [proc.pid]
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"run ended (exit {proc.returncode}) before step {at}{said()}"
            assert time.monotonic() < deadline, f"run did not reach step {at} within {timeout:g}s{said()}"
            if newest_step() >= at:
                break
            time.sleep(0.02)
        group = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)] + [proc.pid]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while [p for p in group if running(p)]:
        assert time.monotonic() < deadline, "processes of the killed run left behind"
        time.sleep(0.2)


def loaded_torch(pid: int) -> bool:
    """Whether process `pid` (on this machine) has torch's library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie. A process can end between any two looks at it
    (a clean-clone CI run saw one pass `pid_exists` and be gone when its status was read)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def drive_step(impl, model: torch.nn.Module, step: int, batch: torch.Tensor, samples: int, lr: float) -> None:
    """One step of a policy's hooks in the worker's order (begin, before forward, backward of
    `model(batch).square().mean()`, end of backward, vote, update, commit); the vote must commit."""
    draft = VoteDraft(samples=samples)
    impl.begin_step(step, draft)
    impl.before_forward(step)
    model(batch).square().mean().backward()
    impl.end_backward(step)
    assert impl.finish_step(step, draft).commit
    impl.apply_update(step, lr)
    impl.commit(step)


class LocalLink:
    """A replica's coordinator, in process: keeps every call, every history record in report order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.records: list[dict] = []
        self.finals: list[dict] = []
        self._lock = threading.Lock()

    def report(self, progress: Progress, wait: bool) -> None:
        with self._lock:
            for record in progress.records:
                (self.finals if record.get("final") else self.records).append(record)

    def _call(self, name: str, *args: Any) -> None:
        with self._lock:
            self.calls.append((name, args))

    def epoch_agreed(self, epoch: int, step: int, records: tuple) -> None:
        self._call("epoch_agreed", epoch, step, records)

    def state_received(self, slot: str, epoch: int, source: str, step: int) -> None:
        self._call("state_received", slot, epoch, source, step)

    def collective_failed(self, slot: str, epoch: int, error: str) -> None:
        self._call("collective_failed", slot, epoch, error)

    def fault_fired(self, index: int, slot: str, step: int, phase: str) -> None:
        self._call("fault_fired", index, slot, step, phase)

    def samples_skipped(self, slot: str, step: int, ids: list[int], reason: str) -> None:
        self._call("samples_skipped", slot, step, ids, reason)

    def save_checkpoint(self, step: int, blob: bytes) -> None:
        self._call("save_checkpoint", step)

    def checkpoints_stored(self, timeout: float) -> None:
        pass  # stored as called


class LocalServerReports:
    """An in-process server's reports go to the `LocalLink` as the server's progress."""

    def __init__(self, link: LocalLink, planner: Any = None) -> None:
        self.link = link
        self.planner = planner
        self.host: Any = None

    def records(self, records: tuple[dict, ...], summary: dict) -> None:
        self.link.report(Progress("server", records[-1]["step"], records[-1]["membership_epoch"], time.time(), records), False)

    def restarted(self, resumed_version: int, incarnation: int, snapshot: str | None) -> None:
        self.link._call("server_restarted", resumed_version, incarnation, snapshot)

    def barrier(self, index: int, members: tuple[str, ...], intervals: dict[str, list[float]]) -> None:
        """elastic_bsp: plan with `planner` and hand the schedule to `host`, as the coordinator does
        (without a planner the server's fallback holds, as with a coordinator that is down)."""
        self.link._call("server_barrier", index, members)
        if self.planner is not None and self.host is not None:
            iterations = self.planner.plan(members, intervals)
            if iterations is not None:
                self.host.set_schedule(index, iterations)


class LocalJob:
    """Real replicas in threads of this process; the test publishes the plans (no coordinator)."""

    def __init__(self, config: dict, slots: list[str], run_dir: str, timeout_s: float = 10.0, zipline: bool = True) -> None:
        """`zipline`: elastic_bsp's barriers are planned as the coordinator plans them (False: the
        server's fallback, as with a coordinator that is down)."""
        from actors.parameter_server import LocalServerClient, ServerHost, make_host
        from actors.replica import Replica
        from algorithms.base import get_algorithm
        from algorithms.zipline import BarrierPlanner
        from core.schema import SERVER_POLICIES, JobConfig, parse

        self.config = parse(JobConfig, config).to_dict()
        self.link = LocalLink()
        self.timeout_s = timeout_s
        self.server: ServerHost | None = None
        """The parameter server, in process, for the server policies."""
        policy = self.config["sync"]["policy"]
        if policy in SERVER_POLICIES or get_algorithm(policy).kind == "background":
            sync = self.config["sync"]
            planner = BarrierPlanner(sync["r"], sync["ewma"]) if sync["policy"] == "elastic_bsp" and zipline else None
            reports = LocalServerReports(self.link, planner)
            self.server = reports.host = make_host(self.config, run_dir, reports)
        client = LocalServerClient(self.server) if self.server else None
        self.replicas = {s: Replica(WorkerSpec("local", "r", s, run_dir, "local", "local", self.config), self.link,
                                    "127.0.0.1", server=client) for s in slots}
        self.version = 0
        self.outcomes: dict[str, dict] = {}
        self._threads: dict[str, threading.Thread] = {}

    def publish(self, members: tuple[str, ...], epoch: int, global_batch: int, **over: Any) -> Plan:
        """Send every replica a plan (a fresh group per call)."""
        host, port = local_store()
        self.version += 1
        plan = Plan(version=self.version, membership_epoch=epoch, members=tuple(members),
                    group_name=f"local/e{epoch}/v{self.version}", store_host=host, store_port=port,
                    timeout_s=self.timeout_s, global_batch=global_batch, **over)
        if self.server is not None:  # as the coordinator does: the server learns a membership before its members
            self.server.set_members(epoch, [(slot, 0) for slot in members])
        for replica in self.replicas.values():
            replica.set_plan(plan)
        return plan

    def start(self, slots: list[str] | None = None) -> None:
        for slot in slots or list(self.replicas):
            thread = threading.Thread(target=lambda s=slot: self.outcomes.__setitem__(s, self.replicas[s].run()),
                                      name=f"replica {slot}", daemon=True)
            self._threads[slot] = thread
            thread.start()

    def wait(self, timeout: float = 120.0) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        for slot, thread in self._threads.items():
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                raise TimeoutError(f"replica {slot} still running after {timeout:g}s")
        if self.server is not None:
            self.server.flush()  # its history records are reported
        return dict(self.outcomes)

    def run(self, members: tuple[str, ...], global_batch: int, timeout: float = 120.0, **plan: Any) -> dict[str, dict]:
        """One plan for `members`, run to the end; every outcome must be ok."""
        self.publish(members, 1, global_batch, **plan)
        self.start(list(members))
        outcomes = self.wait(timeout)
        failed = {s: o for s, o in outcomes.items() if not o["ok"]}
        if failed:
            raise AssertionError(f"replicas failed: {failed}")
        return outcomes

    def parameters(self, slot: str) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.replicas[slot].model.parameters()]


class LoopbackHandle:
    def wait(self, timeout: float | None = None) -> None:
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

    def save_checkpoint(self, step: int, blob: bytes, order=None) -> None:
        self.calls.append(("save_checkpoint", step))

    def recorded(self) -> list[tuple[str, Any]]:
        return list(self.calls)


@ray.remote(num_cpus=0.5, concurrency_groups={"control": 2})
class CommPeer:
    def __init__(self) -> None:
        self.comm: BaseCommunicator | None = None
        self.handle = None
        self.buffer: torch.Tensor | None = None

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

    def start_all_reduce(self, numel: int, die: bool = False, via_ray: bool = False, device: str = "cpu") -> float:
        """Launch an all-reduce of ones; `via_ray`: through `ray.util.collective.allreduce` on the
        group published as a workload would see it (run in a thread; `wait_pending` waits for it)."""
        self.buffer = torch.ones(numel, device=device)
        if via_ray:
            import ray.util.collective as col

            from actors import collective

            collective.publish(self.comm, "bsp")
            name, done = collective.current_group(), threading.Event()

            class Pending:
                def wait(self) -> None:
                    done.wait()
                    if "error" in outcome:
                        raise outcome["error"]

            def call() -> None:
                try:
                    col.allreduce(self.buffer, group_name=name)
                except CommError as err:
                    outcome["error"] = err
                finally:
                    done.set()

            outcome: dict = {}
            threading.Thread(target=call, daemon=True).start()
            self.handle = Pending()
        else:
            self.handle = self.comm.all_reduce(self.buffer)
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        return time.time()

    def wait_pending(self) -> dict:
        try:
            self.handle.wait()
            return {"outcome": "ok", "at": time.time(), "value": float(self.buffer[0])}
        except CommError as err:
            return {"outcome": type(err).__name__, "at": time.time(), "error": str(err)}

    @ray.method(concurrency_group="control")
    def abort(self, reason: str) -> float:
        self.comm.abort(reason)
        return time.time()
