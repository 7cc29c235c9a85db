"""What a week-long job accumulates stays bounded: the plans a worker keeps, the store keys of past
membership epochs (the coordinator's events: tests/integration/test_coordinator_order.py)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from actors.plan import Plan, PlanBook
from actors.transport.comm import GroupSpec, make_communicator, serve_store


def _plan(version: int, members: tuple[str, ...]) -> Plan:
    return Plan(version=version, membership_epoch=version, members=members, group_name=f"g/e{version}",
                store_host="127.0.0.1", store_port=1, timeout_s=1.0, global_batch=8, lr_scale=1.0, backend="gloo",
                stop_step=None, reason="test", history_step=0)


def test_a_worker_keeps_only_the_plans_it_can_still_need():
    book = PlanBook()
    for version in range(1, 10_001):
        book.add(_plan(version, ("w0", "w1") if version == 1 else ("w0",)))
    assert len(book.plans) <= 2, len(book.plans)
    assert book.agreed(10_000).version == 10_000
    # w1 was named by plan 1 only, long superseded: its run() still learns it was admitted, and that
    # the newest plan drops it (it leaves cleanly instead of waiting for a plan naming it)
    assert book.admission("w1").version == 10_000


def _form(port: int, name: str, n: int) -> list:
    specs = [GroupSpec("127.0.0.1", port, name, r, n, 10.0, "gloo", "127.0.0.1") for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        comms = list(pool.map(make_communicator, specs))
    tensors = [torch.ones(4) for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda r: comms[r].all_reduce(tensors[r]).wait(), range(n)))
    for comm in comms:
        comm.close()
    return comms


def test_the_store_keeps_the_keys_of_the_two_newest_epochs_only():
    store, port, _sock = serve_store("127.0.0.1", 10.0)
    from actors.transport.comm import EpochKeys  # the mechanism under test
    keys = EpochKeys(store)
    counts = []
    for epoch in range(1, 8):
        name = f"job/run/c0/e{epoch}"
        keys.entered(name, 3, "gloo")
        _form(port, name, 3)
        _form(port, name + "/bg", 3)  # shadow's background group of the same epoch
        counts.append(store.num_keys())
    per_epoch = counts[0]
    assert per_epoch > 0
    assert counts[1:] == [2 * per_epoch] * 6, counts
