"""Worker actors against a fake coordinator: how a worker takes plans, and how errors come back.

Each test drives real `WorkerActor`s (the actor the coordinator starts) with hand-made plans, so
orderings that are races in a real job (a plan that arrives after `run()`, a plan that a member
must fetch while the coordinator restarts) happen deterministically here.
"""
from __future__ import annotations

import itertools

import pytest
import ray

from actors.plan import Plan, WorkerSpec
from actors.training.worker import WorkerActor
from orchestrator.config import config_from_dict
from testkit.harness import FakeCoordinator, wait_until

TIMEOUT_S = 5.0
_names = itertools.count()


@pytest.fixture
def coordinator(ray_session):
    name = f"fake-coordinator-{next(_names)}"
    fake = FakeCoordinator.options(name=name, namespace="orchestrator").remote(TIMEOUT_S)
    host, port = ray.get(fake.address.remote())
    yield name, fake, host, port
    ray.kill(fake)


def start_workers(coordinator, tmp_path, slots: list[str], **over) -> dict:
    name, _, _, _ = coordinator
    cfg = {"name": "plans", "workers": {"count": len(slots), "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "stop": {"max_steps": 1_000_000}, "eval_every": 0}
    cfg.update(over)
    config = config_from_dict(cfg).to_dict()
    workers = {}
    for slot in slots:
        spec = WorkerSpec("plans", "r", slot, str(tmp_path), name, "orchestrator", config)
        workers[slot] = WorkerActor.options(num_cpus=0.5).remote(spec)
    ray.get([w.ready.remote() for w in workers.values()], timeout=120)
    return workers


def plan(coordinator, version: int, epoch: int, members: tuple[str, ...], **over) -> Plan:
    _, _, host, port = coordinator
    fields = dict(version=version, membership_epoch=epoch, members=members, group_name=f"plans/c0/e{epoch}-{next(_names)}",
                  store_host=host, store_port=port, timeout_s=TIMEOUT_S, global_batch=8 * len(members))
    fields.update(over)
    return Plan(**fields)


def test_joiner_run_waits_for_a_plan_that_names_it(coordinator, tmp_path):
    """`run()` and `set_plan` travel on different concurrency groups, so a joiner's `run()` can
    start while its newest plan is one published before it was admitted. It must wait for the
    plan that names it instead of leaving at once (the slot would be marked finished)."""
    worker = start_workers(coordinator, tmp_path, ["w2"])["w2"]
    ray.get(worker.set_plan.remote(plan(coordinator, 1, 1, ("w0", "w1"))))
    ref = worker.run.remote()
    done, _ = ray.wait([ref], timeout=2.0)
    assert not done, f"run() returned on a plan that does not name the joiner: {ray.get(ref)}"
    ray.get(worker.set_plan.remote(plan(coordinator, 2, 2, ("w2",), stop_step=3)))
    outcome = ray.get(ref, timeout=60)
    assert outcome.ok and outcome.step == 3, outcome
    ray.kill(worker)


def test_a_plan_missing_during_a_coordinator_restart_is_awaited_not_a_crash(coordinator, tmp_path):
    """Members switch plans at the step the vote agrees on; one that never received the agreed
    plan used to fetch it from the coordinator, and a coordinator restarting meanwhile made that
    call raise, failing a healthy worker. The plan is on its way (every member is sent it): wait."""
    _, fake, _, _ = coordinator
    workers = start_workers(coordinator, tmp_path, ["w0", "w1"])
    first = plan(coordinator, 1, 1, ("w0", "w1"))
    ray.get([w.set_plan.remote(first) for w in workers.values()])
    refs = {slot: w.run.remote() for slot, w in workers.items()}
    wait_until(lambda: min(ray.get([w.heartbeat.remote() for w in workers.values()]), key=lambda b: b.step).step > 5,
               what="both workers training")
    newer = plan(coordinator, 2, 1, ("w0", "w1"), group_name=first.group_name, stop_step=0)
    ray.get(fake.add_plan.remote(newer))
    ray.get(fake.fail_get_plan.remote("coordinator is restarting (ActorUnavailableError)"))
    ray.get(workers["w0"].set_plan.remote(newer))  # w1 is not told yet: it learns from the vote
    ray.get(workers["w1"].set_plan.remote(newer))
    outcomes = ray.get(list(refs.values()), timeout=60)
    assert all(o.ok for o in outcomes) and outcomes[0].step == outcomes[1].step, outcomes
    for w in workers.values():
        ray.kill(w)


def test_a_failure_to_build_the_group_reports_its_real_cause(coordinator, tmp_path):
    """An error while a group forms (here: NCCL asked for on a machine without CUDA or without a
    torch built with NCCL) must come back with its own text, not as `KeyError: 'comm'`."""
    worker = start_workers(coordinator, tmp_path, ["w0"])["w0"]
    ray.get(worker.set_plan.remote(plan(coordinator, 1, 1, ("w0",), backend="nccl")))
    outcome = ray.get(worker.run.remote(), timeout=60)
    assert not outcome.ok
    assert "KeyError" not in outcome.error and "NCCL needs a CUDA device" in outcome.error, outcome.error
    ray.kill(worker)
