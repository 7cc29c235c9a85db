"""Doubles that run in this process, without Ray (policy oracles in milliseconds):

- `LocalJob` runs real `Replica`s (the worker's step loop) in threads, with a recording `LocalLink` for
  their coordinator and plans the test publishes itself (`LocalServerReports` for an in-process server);
- `LoopbackComm` is a world-size-1 communicator that only records calls; `drive_step` runs one step of
  a policy's hooks in the worker's order.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from actors.messages import RunOutcome
from actors.plan import Plan, Progress, WorkerSpec
from actors.transport.comm import in_process_store as local_store
from algorithms.policies.base import VoteDraft


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

    def transport_fallback(self, slot: str, epoch: int, group: str, reason: str) -> None:
        self._call("transport_fallback", slot, epoch, group, reason)

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


STARTED: list[LocalJob] = []
"""The LocalJobs started since the last `close_started` (the tests' fixture ends those left running)."""


def close_started() -> list[str]:
    """End the replicas of every LocalJob started since the last call that are still running; their slots."""
    left = [slot for job in STARTED for slot in job.close()]
    STARTED.clear()
    return left


class LocalJob:
    """Real replicas in threads of this process; the test publishes the plans (no coordinator)."""

    def __init__(self, config: dict, slots: list[str], run_dir: str, timeout_s: float = 10.0, zipline: bool = True,
                 wrap_link: Callable[[LocalLink], Any] | None = None,
                 exit_if_stuck: Callable[[str], None] | None = None) -> None:
        """`zipline`: elastic_bsp's barriers are planned as the coordinator plans them (False: the
        server's fallback, as with a coordinator that is down); `wrap_link`: what the replicas reach the
        recording link through (a test's slow or lossy one); `exit_if_stuck`: as the worker actor's."""
        from actors.server.parameter_server import make_host
        from actors.server.server_client import LocalServerClient
        from actors.server.server_host import ServerHost
        from actors.training.replica import Replica
        from algorithms.policies.base import get_algorithm
        from algorithms.rules.zipline import BarrierPlanner
        from core.schema import SERVER_POLICIES, JobConfig, parse

        self.config = parse(JobConfig, config).to_dict()
        self.link = LocalLink()
        self.timeout_s = timeout_s
        self.server: ServerHost | None = None
        """The parameter server, in process, for the server policies."""
        policy = self.config["sync"]["policy"]
        if policy in SERVER_POLICIES or get_algorithm(policy).kind.dispenses_leases:  # a test's fake server kind brings its own
            sync = self.config["sync"]
            planner = BarrierPlanner(sync["r"], sync["ewma"]) if sync["policy"] == "elastic_bsp" and zipline else None
            reports = LocalServerReports(self.link, planner)
            self.server = reports.host = make_host(self.config, run_dir, reports)
        client = LocalServerClient(self.server) if self.server else None
        link = self.link if wrap_link is None else wrap_link(self.link)
        gpus = self.config["workers"].get("gpus", 0)
        whole = gpus >= 1 and torch.cuda.is_available()  # each replica on a GPU of its own, where there are several
        self.replicas = {s: Replica(WorkerSpec("local", "r", s, run_dir, "local", "local", self.config), link,
                                    "127.0.0.1", server=client, exit_if_stuck=exit_if_stuck,
                                    device_index=i % torch.cuda.device_count() if whole else 0)
                         for i, s in enumerate(slots)}
        self.version = 0
        self.outcomes: dict[str, RunOutcome] = {}
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
        STARTED.append(self)
        for slot in slots or list(self.replicas):
            thread = threading.Thread(target=lambda s=slot: self.outcomes.__setitem__(s, self.replicas[s].run()),
                                      name=f"replica {slot}", daemon=True)
            self._threads[slot] = thread
            thread.start()

    def wait(self, timeout: float = 120.0) -> dict[str, RunOutcome]:
        deadline = time.monotonic() + timeout
        joined: set[str] = set()
        while len(joined) < len(self._threads):  # a replica may be started while the others run (a joiner)
            slot, thread = next((s, t) for s, t in list(self._threads.items()) if s not in joined)
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                raise TimeoutError(f"replica {slot} still running after {timeout:g}s")
            joined.add(slot)
        if self.server is not None:
            self.server.flush()  # its history records are reported
        return dict(self.outcomes)

    def run(self, members: tuple[str, ...], global_batch: int, timeout: float = 120.0, **plan: Any) -> dict[str, RunOutcome]:
        """One plan for `members`, run to the end; every outcome must be ok."""
        self.publish(members, 1, global_batch, **plan)
        self.start(list(members))
        outcomes = self.wait(timeout)
        failed = {s: o for s, o in outcomes.items() if not o.ok}
        if failed:
            raise AssertionError(f"replicas failed: {failed}")
        return outcomes

    def parameters(self, slot: str) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.replicas[slot].training.model.parameters()]

    def agreed_parameters(self, slots: list[str]) -> list[torch.Tensor]:
        """The first slot's parameters, after checking every slot's replica ends at the same state."""
        first = self.parameters(slots[0])
        for slot in slots[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, self.parameters(slot))), f"{slot} differs from {slots[0]}"
        return first

    def close(self, timeout: float = 30.0) -> list[str]:
        """End replicas still running (a test that failed before its stop): a plan with no members that
        aborts every epoch before it, so each member fails the step under way, finds itself outside the
        plan and leaves. Returns the slots that were still running. (A replica left running trains on
        in its thread and reseeds the process's random generator at every step: the tests after it in
        the same process then draw different initial models.)"""
        running = [s for s, t in self._threads.items() if t.is_alive()]
        if not running:
            return []
        epoch = max((r.plan.membership_epoch for r in self.replicas.values() if r.plan is not None), default=0)
        self.publish((), epoch + 1, 1, aborts_epoch=epoch, reason="the test ended")
        deadline = time.monotonic() + timeout
        for slot in running:
            self._threads[slot].join(max(deadline - time.monotonic(), 0.0))
        return running


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


