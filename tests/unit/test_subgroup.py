"""A group's subgroup (`comm.subgroup`, what hierarchical all-reduce runs its leaders on): formed by the
ranks it names over the group's own store, it reduces among them alone, carries the group's key and
modelled latencies, and an abort of the group releases a wait in the subgroup at once. In process (no
Ray): members of one gloo group formed in threads over an in-memory store."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from actors.transport.comm import CommAborted, CommTimeout, GroupSpec, make_communicator
from testkit.harness import local_store

KEY = b"k" * 32
TIMEOUT_S = 3.0
"""The control case's timeout (it waits for it)."""
LONG_S = 60.0
"""The timeout where the abort is what releases a wait: only the abort can, within the test."""



def group(n: int, name: str, timeout_s: float = TIMEOUT_S) -> list:
    host, port = local_store()
    specs = [GroupSpec(host, port, name, r, n, timeout_s, "gloo", "127.0.0.1", secret=KEY) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(make_communicator, specs))


def test_a_subgroup_of_two_of_four_reduces_among_them_only():
    comms = group(4, "job/r/c0/e1")
    for c in comms:
        c.link_latency_s = [[0.0 if a // 2 == b // 2 else 0.001 for b in range(4)] for a in range(4)]
    with ThreadPoolExecutor(4) as pool:
        subs = list(pool.map(lambda c: c.subgroup([0, 2], "leaders"), comms))
    assert subs[1] is None and subs[3] is None
    assert (subs[0].rank, subs[2].rank, subs[0].world_size) == (0, 1, 2)
    assert subs[0].link_latency_s == [[0.0, 0.001], [0.001, 0.0]], "the members' own links"
    tensors = {0: torch.full((5,), 1.0), 2: torch.full((5,), 10.0)}
    handles = [subs[r].all_reduce(tensors[r]) for r in (0, 2)]
    for h in handles:
        h.wait()
    assert all(torch.equal(t, torch.full((5,), 11.0)) for t in tensors.values())
    for c in comms:
        c.close()


def _stuck_in_subgroup(propagate: bool) -> tuple[str, float]:
    """Ranks 0 and 1 form a subgroup; rank 0 all-reduces in it while rank 1 never does. The group is
    aborted 0.3 s later: how long rank 0's wait lasts, and how it ends. `propagate=False` switches the
    group's abort off for its subgroups (the control: only the timeout frees the wait). With the abort
    on, the group's timeout is 60 s: a wait that ends as `CommAborted` was ended by the abort."""
    comms = group(3, f"job/r/c0/e{2 + propagate}", LONG_S if propagate else TIMEOUT_S)
    with ThreadPoolExecutor(2) as pool:
        subs = list(pool.map(lambda c: c.subgroup([0, 1], "leaders"), comms[:2]))
    if not propagate:
        comms[0]._children = []
    handle = subs[0].all_reduce(torch.ones(1000))
    threading.Timer(0.3, lambda: comms[0].abort("a member died")).start()
    began = time.monotonic()
    try:
        handle.wait()
        outcome = "finished"
    except (CommAborted, CommTimeout) as err:
        outcome = type(err).__name__
    waited = time.monotonic() - began
    for c in comms:
        c.close()
    return outcome, waited


@pytest.mark.parametrize("propagate", [True, False], ids=["abort reaches the subgroup", "switched off"])
def test_an_abort_of_the_group_releases_a_wait_in_its_subgroup(propagate):
    outcome, waited = _stuck_in_subgroup(propagate)
    print(f"propagate={propagate}: {outcome} after {waited:.2f}s")
    if propagate:
        assert outcome == "CommAborted"
    else:
        assert outcome == "CommTimeout" and waited >= TIMEOUT_S * 0.9


def test_an_abort_during_formation_abandons_it_at_once():
    """Rank 1 never comes to form the subgroup: rank 0's formation waits until the group is aborted."""
    comms = group(2, "job/r/c0/e5", LONG_S)  # only the abort ends the formation within the test
    threading.Timer(0.3, lambda: comms[0].abort("a member died")).start()
    with pytest.raises(CommAborted):
        comms[0].subgroup([0, 1], "leaders")
    for c in comms:
        c.close()
