"""A group's formation has its own timeout (`comm.formation_timeout_s`; actors/transport): a member that
arrives after `comm.timeout_s` but within the formation timeout still forms the group, and the formed
group's operations keep the tight `comm.timeout_s`. With no formation timeout (the mechanism off), the
same late member misses the group. Two gloo members in threads of this process; the late arrival is
the mechanism (a time), so rank 1 starts forming a fixed time after rank 0 has begun. Each forms as
a member does (`form_in_thread`: abandoned `formation_timeout_s` + 5 s after it began)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from actors.transport.factory import make_communicator
from actors.transport.formation import form_in_thread
from actors.transport.stores import in_process_store
from core.comm_api import CommError, CommTimeout, GroupSpec

OP_S, LATE_S = 1.0, 3.0


def form_with_a_late_member(formation_timeout_s: float | None, name: str):
    host, port = in_process_store()
    specs = [GroupSpec(host, port, name, r, 2, OP_S, "gloo", "127.0.0.1", formation_timeout_s=formation_timeout_s)
             for r in range(2)]
    began = threading.Event()

    def member(rank: int):
        if rank == 1:
            began.wait(30)
            time.sleep(LATE_S)  # later than comm.timeout_s
        else:
            began.set()
        spec = specs[rank]  # formed as a member forms its epoch's group: given up after the formation timeout
        return form_in_thread(spec, lambda: make_communicator(spec), lambda: False)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(member, r) for r in range(2)]
        return [f.exception() or f.result() for f in futures]


def test_a_member_later_than_the_operation_timeout_forms_within_the_formation_timeout():
    comms = form_with_a_late_member(formation_timeout_s=20.0, name="late-formed")
    assert not any(isinstance(c, BaseException) for c in comms), comms
    try:
        t = torch.ones(4)
        handles = [c.all_reduce(t.clone()) for c in comms]
        for h in handles:
            h.wait()
        started = time.monotonic()
        with pytest.raises(CommTimeout):  # rank 1 never joins this one: the operation's own timeout
            comms[0].all_reduce(torch.ones(4)).wait()
        waited = time.monotonic() - started
        assert waited < 20.0 / 2, waited  # the operation's 1 s (with margin), not the formation's 20 s
    finally:
        for c in comms:
            c.abort("test over")
            c.close()


def test_without_a_formation_timeout_the_same_late_member_misses_the_group():
    comms = form_with_a_late_member(formation_timeout_s=None, name="late-missed")
    assert any(isinstance(c, CommError) for c in comms), comms
    for c in comms:
        if not isinstance(c, BaseException):
            c.abort("test over")
            c.close()
