"""The coordinator reaches a worker through typed calls (actors/control/workers.py `WorkerGroup`), one per
method of the worker actor (actors/training/worker.py `Worker`), never by a method's name in a string: a renamed
or re-shaped worker method breaks this test and the type checker, not a job at run time."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from actors.control.workers import RayWorkerGroup, WorkerGroup
from actors.training.worker import Worker
from testkit.fake_workers import FakeWorkerGroup

REPO = Path(__file__).resolve().parents[2]
CALLS = ("set_plan", "abort_epoch", "run", "ready", "adopt", "heartbeat", "final_state", "load_checkpoint",
         "probe_heartbeat", "status", "records_after", "evaluate_state")
"""The port's calls to a worker; `probe_heartbeat` is the worker's `heartbeat`, asked as a probe."""


def _params(fn, skip: tuple[str, ...]) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in skip and not p.startswith("_ray")]  # Ray adds its tracing context


def test_each_call_of_the_port_is_a_worker_method_with_the_same_arguments():
    for name in CALLS:
        worker = getattr(Worker, "heartbeat" if name == "probe_heartbeat" else name)
        assert _params(getattr(WorkerGroup, name), ("self", "handle", "timeout")) == _params(worker, ("self",)), name


def test_the_ray_group_and_the_fake_implement_every_call_with_the_ports_signature():
    for group in (RayWorkerGroup, FakeWorkerGroup):
        for name in CALLS:
            ours = getattr(group, name)
            assert ours is not getattr(WorkerGroup, name), f"{group.__name__} does not implement {name}"
            assert _params(ours, ()) == _params(getattr(WorkerGroup, name), ()), (group.__name__, name)
            assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(getattr(WorkerGroup, name))


def test_no_call_to_a_worker_names_its_method_in_a_string():
    """No port method takes a method's name, and no module of the coordinator's process looks a method up
    on a handle by name (`getattr(handle, ...)`), not even a restarted coordinator's call to its own `start`."""
    for group in (WorkerGroup, RayWorkerGroup, FakeWorkerGroup):
        for name, fn in inspect.getmembers(group, inspect.isfunction):
            assert "method" not in inspect.signature(fn).parameters, f"{group.__name__}.{name}"
    files = [*sorted((REPO / "actors" / "control").glob("*.py")), REPO / "actors/control/coordinator.py",
             REPO / "testkit" / "fake_workers.py"]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == "handle":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "method":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def test_the_workers_calls_to_the_coordinator_name_its_methods_and_carry_their_order():
    """The other direction: the worker's link (actors/training/worker.py `RayLink`) calls each coordinator
    method as an attribute of the handle, never by a name in a string, and each one it calls exists on
    the coordinator actor and takes the link's `order` (its place in the sender's sequence)."""
    from actors.control.coordinator import Coordinator

    path = REPO / "actors/training/worker.py"
    called = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            assert not (isinstance(node.args[0], ast.Call) and getattr(node.args[0].func, "attr", "") == "_coord"), \
                f"worker.py:{node.lineno} looks a coordinator method up by name"
        if isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.value, ast.Attribute) \
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "c":
            called.add(node.value.attr)
    assert called >= {"report", "epoch_agreed", "state_received", "collective_failed", "fault_fired",
                      "samples_skipped", "save_checkpoint"}, called
    for name in called:
        method = getattr(Coordinator, name, None)
        assert method is not None, f"the coordinator has no {name}"
        assert "order" in inspect.signature(method).parameters, name


def test_the_drivers_calls_to_the_coordinator_name_its_methods():
    """The driver (orchestrator/job.py `ElasticJob._ask`) names each coordinator method as an attribute
    of the handle too, and each one it calls exists on the coordinator actor."""
    from actors.control.coordinator import Coordinator

    tree = ast.parse((REPO / "orchestrator/job.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            assert not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("coordinator", "c")), \
                f"job.py:{node.lineno} looks a coordinator method up by name"
    called = {node.value.attr for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and node.value.value.id in ("c", "coordinator")}
    assert called >= {"status", "watch_feed", "request_stop", "scale"}, called
    assert all(hasattr(Coordinator, name) for name in called), called
