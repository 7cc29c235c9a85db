"""The shared-memory all-reduce of a group whose members all run on one node (actors/transport/shm.py),
in process: members of one gloo group formed in threads over an in-memory store."""
from __future__ import annotations

import glob
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from actors.transport import shm
from actors.transport.comm import CommAborted, GroupSpec, make_communicator
from testkit.harness import local_store


def group(n: int, name: str, addresses: list[str] | None = None, timeout_s: float = 10.0) -> list:
    host, port = local_store()
    specs = [GroupSpec(host, port, name, r, n, timeout_s, "gloo", (addresses or ["127.0.0.1"] * n)[r]) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(make_communicator, specs))


def in_threads(comms, work) -> list:
    """`work(rank, comm)` in one thread per member (each member's operations are its own thread's)."""
    out: list = [None] * len(comms)

    def run(r: int) -> None:
        out[r] = work(r, comms[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_every_member_gets_the_reduction_and_the_same_bits(op):
    """Three members, three operations launched before any is waited on (each pair of them shares its
    slots with the one two before): each result is the reduction of the members' tensors, in rank order
    for the sum, and the same bits on every member."""
    comms = group(3, f"shm-{op}")
    assert all(c.shared_memory for c in comms)
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(1000, generator=gen, dtype=torch.float32) for _ in range(3)] for _ in range(3)]  # [op][rank]

    def work(r: int, comm) -> list[torch.Tensor]:
        mine = [inputs[k][r].clone() for k in range(3)]
        handles = [comm.all_reduce(t, op) for t in mine]
        for h in handles:
            h.wait()
        return mine

    results = in_threads(comms, work)
    for k in range(3):
        a, b, c = inputs[k]
        expected = {"sum": (a + b) + c, "max": torch.maximum(torch.maximum(a, b), c),
                    "min": torch.minimum(torch.minimum(a, b), c)}[op]
        for r in range(3):
            assert torch.equal(results[r][k], expected), (k, r)
    for comm in comms:
        comm.close()


def test_an_abort_releases_a_member_waiting_on_a_peer_that_never_launches():
    """Member 0 launches and waits; member 1 never launches. The group's timeout is 60 s: the abort,
    from another thread, must release the wait with CommAborted (the wait checks the group's abort
    whenever its pipe wakes it, and the abort writes into that pipe)."""
    comms = group(2, "shm-abort", timeout_s=60.0)
    tensor = torch.ones(10)
    handle = comms[0].all_reduce(tensor)
    waiting = threading.Event()
    outcome: dict = {}

    def wait() -> None:
        waiting.set()
        try:
            handle.wait()
            outcome["ok"] = True
        except CommAborted as err:
            outcome["error"] = err

    thread = threading.Thread(target=wait)
    thread.start()
    waiting.wait(10)
    comms[0].abort("peer died")
    thread.join(30)
    assert not thread.is_alive(), "the abort did not release the wait"
    assert isinstance(outcome.get("error"), CommAborted), outcome
    for comm in comms:
        comm.close()


def test_the_files_are_unlinked_once_every_member_has_done_one_operation():
    """Each member's file and pipe exist from before the group forms until its first operation is done;
    then /dev/shm holds nothing of the group (a member killed later leaves nothing behind)."""
    host, port = local_store()
    name = "shm-unlink"
    specs = [GroupSpec(host, port, name, r, 2, 10.0, "gloo", "127.0.0.1") for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        comms = list(pool.map(make_communicator, specs))
    paths = [f"{shm.DIRECTORY}/{c._shm.name}.{kind}" for c in comms for kind in ("seg", "fifo")]
    assert len(set(paths)) == 4 and all(glob.glob(p) for p in paths)  # two files and two pipes
    in_threads(comms, lambda r, c: c.all_reduce(torch.ones(4)).wait())
    assert not any(glob.glob(p) for p in paths)
    for comm in comms:
        comm.close()


def test_members_on_different_addresses_all_reduce_through_gloo():
    """Two members whose gloo devices are on two addresses (two lab nodes): no shared memory, the sum is
    gloo's."""
    comms = group(2, "shm-two-nodes", ["127.0.0.1", "127.0.0.2"])
    assert not any(c.shared_memory for c in comms)
    results = in_threads(comms, lambda r, c: (t := torch.full((5,), float(r + 1)), c.all_reduce(t).wait(), t)[2])
    assert all(torch.equal(t, torch.full((5,), 3.0)) for t in results)
    for comm in comms:
        comm.close()


def test_a_settling_group_sweeps_the_files_of_members_whose_process_is_gone(tmp_path):
    """A member killed between its group's formation and its first operation leaves its file and pipe;
    `sweep` (run when a later group settles) unlinks those whose process (the header's pid) is gone and
    keeps a live one's."""
    import os
    import subprocess

    import numpy as np

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = os.path.join(shm.DIRECTORY, "orchestrator-00000000dead0000")
    live = os.path.join(shm.DIRECTORY, "orchestrator-000000001ive0000")
    try:
        for base, pid in ((dead, gone.pid), (live, os.getpid())):
            with open(base + ".seg", "wb") as f:
                f.write(np.array([1, 1, pid], dtype=np.int64).tobytes())
            os.mkfifo(base + ".fifo")
        assert shm.sweep() >= 2
        assert not os.path.exists(dead + ".seg") and not os.path.exists(dead + ".fifo")
        assert os.path.exists(live + ".seg") and os.path.exists(live + ".fifo")
    finally:
        for path in (dead + ".seg", dead + ".fifo", live + ".seg", live + ".fifo"):
            if os.path.exists(path):
                os.unlink(path)


def test_a_tensor_larger_than_a_slot_goes_through_gloo_on_both_paths(monkeypatch):
    """A tensor larger than a slot (here the slots are taken as 64 bytes) goes through gloo, from a
    handle (`all_reduce`) and from torch's reducer (`process_group().allreduce`), while a small one still
    goes through shared memory; every member decides alike, so both sums are right."""
    from actors.transport import gloo

    monkeypatch.setattr(gloo, "SLOT_BYTES", 64)
    comms = group(2, "shm-large")
    assert all(c.shared_memory for c in comms)

    def work(r: int, comm) -> list[torch.Tensor]:
        big, small, lent = torch.full((1000,), float(r + 1)), torch.full((4,), float(r + 1)), torch.full((500,), float(r + 1))
        comm.all_reduce(big).wait()
        comm.all_reduce(small).wait()
        comm.process_group().allreduce([lent]).wait()
        return [big, small, lent, comm._shm.finished]

    results = in_threads(comms, work)
    for big, small, lent, through_shm in results:
        assert torch.equal(big, torch.full((1000,), 3.0)) and torch.equal(small, torch.full((4,), 3.0))
        assert torch.equal(lent, torch.full((500,), 3.0))
        assert through_shm == 1  # the small one alone
    for comm in comms:
        comm.close()
