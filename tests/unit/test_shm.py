"""The shared-memory all-reduce of a group whose members all run on one node (actors/transport/shm.py):
members of one gloo group formed in threads over an in-memory store, or, where the mechanism is the
operating system's (a process's death, a mount namespace's own /dev/shm, a full tmpfs), in child
processes of the test over a TCP store."""
from __future__ import annotations

import errno
import glob
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from actors.transport import shm
from actors.transport.comm import CommAborted, CommError, GroupSpec, make_communicator, serve_store
from testkit.harness import local_store

REPO = Path(__file__).resolve().parents[2]


def group(n: int, name: str, addresses: list[str] | None = None, timeout_s: float = 10.0, reduce_bytes: int = 0) -> list:
    host, port = local_store()
    specs = [GroupSpec(host, port, name, r, n, timeout_s, "gloo", (addresses or ["127.0.0.1"] * n)[r],
                       reduce_bytes=reduce_bytes) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(make_communicator, specs))


def in_threads(comms, work) -> list:
    """`work(rank, comm)` in one thread per member (each member's operations are its own thread's)."""
    out: list = [None] * len(comms)

    def run(r: int) -> None:
        try:
            out[r] = work(r, comms[r])
        except Exception as err:  # noqa: BLE001 - the test reads it
            out[r] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def close(comms) -> None:
    for comm in comms:
        comm.close()


def leftovers(*names: str) -> list[str]:
    return [p for name in names for p in glob.glob(f"{shm.DIRECTORY}/{name}.*")]


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
    close(comms)


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
    close(comms)


def test_the_files_are_unlinked_as_soon_as_every_member_has_attached():
    """Every member opens every peer's file and pipe while the group forms and says so through the
    store; each then unlinks its own. Once formed, /dev/shm holds nothing of the group (a member killed
    from then on, even by SIGKILL, leaves nothing behind), and the group all-reduces through it."""
    comms = group(2, "shm-unlink")
    assert all(c.shared_memory for c in comms)
    assert leftovers(*(c._shm.name for c in comms)) == []
    results = in_threads(comms, lambda r, c: (t := torch.full((4,), float(r + 1)), c.all_reduce(t).wait(), t)[2])
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in results)
    close(comms)


def test_members_on_different_addresses_all_reduce_through_gloo():
    """Two members whose gloo devices are on two addresses (two lab nodes): no shared memory, the sum is
    gloo's, and nothing to report."""
    comms = group(2, "shm-two-nodes", ["127.0.0.1", "127.0.0.2"])
    assert not any(c.shared_memory for c in comms)
    assert [c.shm_fallback for c in comms] == [None, None]
    results = in_threads(comms, lambda r, c: (t := torch.full((5,), float(r + 1)), c.all_reduce(t).wait(), t)[2])
    assert all(torch.equal(t, torch.full((5,), 3.0)) for t in results)
    close(comms)


def test_a_cpu_whose_memory_model_is_not_x86s_keeps_gloo(monkeypatch):
    """The counts are published without a fence, which only x86 keeps in order: elsewhere (here an
    aarch64 machine, as `platform` reports it) the group all-reduces through gloo, silently."""
    monkeypatch.setattr(shm.platform, "machine", lambda: "aarch64")
    comms = group(2, "shm-arm")
    assert not any(c.shared_memory for c in comms)
    assert [c.shm_fallback for c in comms] == [None, None]
    results = in_threads(comms, lambda r, c: (t := torch.full((3,), float(r + 1)), c.all_reduce(t).wait(), t)[2])
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in results)
    close(comms)


def test_members_that_do_not_share_one_dev_shm_agree_on_gloo_and_say_why(monkeypatch):
    """One address is not one node: members whose /dev/shm or IPC namespace differ (here each member's
    identity made distinct) all keep gloo, each with the same one-line reason."""
    real = shm.node_identity
    calls = iter(range(100))
    monkeypatch.setattr(shm, "node_identity", lambda: f"{real()}-{next(calls)}")
    comms = group(2, "shm-two-namespaces")
    assert not any(c.shared_memory for c in comms)
    reasons = {c.shm_fallback for c in comms}
    assert len(reasons) == 1 and "do not share one /dev/shm and IPC namespace" in reasons.pop()
    results = in_threads(comms, lambda r, c: (t := torch.full((5,), float(r + 1)), c.all_reduce(t).wait(), t)[2])
    assert all(torch.equal(t, torch.full((5,), 3.0)) for t in results)
    close(comms)


def test_one_members_failed_attach_makes_every_member_use_gloo(monkeypatch):
    """Rank 1 of three cannot open a peer's file: every member learns it through the store before any
    operation, all three keep gloo with the same reason (naming rank 1), and their sums are right."""
    attach = shm.SharedMemoryGroup.attach

    def failing(self, names):
        if self.rank == 1:
            raise shm.Unusable("Permission denied: /dev/shm/orchestrator-0000000000000000.seg")
        attach(self, names)

    monkeypatch.setattr(shm.SharedMemoryGroup, "attach", failing)
    comms = group(3, "shm-attach-fails")
    assert [c.shared_memory for c in comms] == [False, False, False]
    reasons = {c.shm_fallback for c in comms}
    assert len(reasons) == 1
    reason = reasons.pop()
    assert reason is not None and "rank 1: Permission denied" in reason and "all-reduces through gloo" in reason
    results = in_threads(comms, lambda r, c: (t := torch.full((5,), float(r + 1)), c.all_reduce(t).wait(), t)[2])
    assert all(torch.equal(t, torch.full((5,), 6.0)) for t in results)
    close(comms)


def test_a_failed_attach_leaves_nothing_half_built():
    """A peer gone before the attach (its files unlinked): the attach fails, and the member's next
    operation raises CommError, never an IndexError from a half-filled list."""
    mine, peer = shm.SharedMemoryGroup(0, 2, 4096), shm.SharedMemoryGroup(1, 2, 4096)
    peer.close()
    with pytest.raises(shm.Unusable, match="No such file or directory"):
        mine.attach([mine.name, peer.name])
    with pytest.raises(CommError, match="not attached"):
        mine.launch(torch.ones(4), "sum", 1.0, lambda: False, "shm-half")
    mine.close()


@pytest.mark.parametrize("plant", ["link", "size", "pipe"])
def test_the_attach_refuses_a_link_a_wrong_size_or_a_pipe_under_a_members_name(plant, tmp_path):
    """A peer's file is opened without following a link, and only as this user's regular file of the
    group's size (a pipe under a file's name is not waited on): anything else fails the attach."""
    mine, peer = shm.SharedMemoryGroup(0, 2, 4096), shm.SharedMemoryGroup(1, 2, 4096)
    seg = f"{shm.DIRECTORY}/{peer.name}.seg"
    moved = f"{shm.DIRECTORY}/{peer.name}.moved"
    try:
        if plant == "link":
            os.rename(seg, moved)
            os.symlink(moved, seg)
        elif plant == "size":
            os.truncate(seg, shm.HEADER + 4096)
        else:
            os.unlink(seg)
            os.mkfifo(seg, 0o600)
        expected = {"link": "Too many levels of symbolic links", "size": "not this user's regular file",
                    "pipe": "not this user's regular file"}[plant]
        with pytest.raises(shm.Unusable, match=expected):
            mine.attach([mine.name, peer.name])
    finally:
        for path in (seg, moved):
            if os.path.lexists(path):
                os.unlink(path)
        mine.close()
        peer.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_the_attach_refuses_another_users_file():
    """A file under a member's name owned by another user (planted there after the member's was swept)
    is refused: its values are never summed in."""
    mine, peer = shm.SharedMemoryGroup(0, 2, 4096), shm.SharedMemoryGroup(1, 2, 4096)
    try:
        os.chown(f"{shm.DIRECTORY}/{peer.name}.seg", 65534, 65534)
        with pytest.raises(shm.Unusable, match="not this user's regular file"):
            mine.attach([mine.name, peer.name])
    finally:
        mine.close()
        peer.close()


def _fake_member(base: str, slot: int) -> int:
    """A member's file as a member makes it (a whole header and size), and its pipe; returns the file's
    descriptor (the caller decides whether to hold the member's lock on it)."""
    fd = os.open(base + ".seg", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, shm.HEADER + 2 * slot)
    os.pwrite(fd, np.array([0, 0, os.getpid(), slot], dtype=np.int64).tobytes(), 0)
    os.mkfifo(base + ".fifo", 0o600)
    return fd


def test_a_settling_group_sweeps_the_files_of_members_that_are_gone():
    """A member killed while its group formed leaves its file and pipe; `sweep` (run when a later group
    settles) unlinks those whose lock is free (the member is gone, reaped or not) and keeps a live one's."""
    import fcntl

    dead = os.path.join(shm.DIRECTORY, "orchestrator-00000000dead0000")
    live = os.path.join(shm.DIRECTORY, "orchestrator-000000001ive0000")
    fds = [_fake_member(dead, 4096), _fake_member(live, 4096)]
    try:
        os.close(fds.pop(0))  # the dead member's lock went with it
        fcntl.flock(fds[0], fcntl.LOCK_EX)  # the live one holds its own
        assert shm.sweep() >= 2
        assert not os.path.exists(dead + ".seg") and not os.path.exists(dead + ".fifo")
        assert os.path.exists(live + ".seg") and os.path.exists(live + ".fifo")
    finally:
        for fd in fds:
            os.close(fd)
        for path in (dead + ".seg", dead + ".fifo", live + ".seg", live + ".fifo"):
            if os.path.exists(path):
                os.unlink(path)


def test_the_sweep_neither_blocks_on_a_pipe_nor_follows_a_link():
    """Anyone on the node can plant a pipe or a link under a member's file name: the sweep opens without
    blocking or following, so it returns at once and leaves both (and the link's target) alone."""
    pipe = os.path.join(shm.DIRECTORY, "orchestrator-ffffffffffffffff.seg")
    link = os.path.join(shm.DIRECTORY, "orchestrator-fffffffffffffffe.seg")
    target = os.path.join(shm.DIRECTORY, "orchestrator-fffffffffffffffd")
    os.mkfifo(pipe, 0o600)
    os.close(_fake_member(target, 4096))  # a whole file whose lock is free: a dead member's, if followed
    os.symlink(target + ".seg", link)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (shm.sweep(), done.set()), daemon=True)
    try:
        thread.start()
        assert done.wait(10), "sweep blocked on a pipe planted under a member's name"
        assert os.path.lexists(pipe) and os.path.islink(link)
    finally:
        if not done.is_set():  # release the blocked open (a writer arrives)
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(10)
        for path in (pipe, link, target + ".seg", target + ".fifo"):
            if os.path.lexists(path):
                os.unlink(path)


def test_a_tensor_larger_than_the_slot_goes_through_gloo_on_both_paths():
    """The group's slot is sized from its spec (`reduce_bytes`: 64 bytes, a page here): a larger tensor goes
    through gloo, from a handle (`all_reduce`) and from torch's reducer (`process_group().allreduce`),
    while a small one still goes through shared memory; every member decides alike, so both sums are right."""
    comms = group(2, "shm-large", reduce_bytes=64)
    assert all(c.shared_memory for c in comms) and comms[0]._shm.slot == shm.slot_bytes(64) == 4096

    def work(r: int, comm) -> list:
        big, small, lent = torch.full((2000,), float(r + 1)), torch.full((4,), float(r + 1)), torch.full((1500,), float(r + 1))
        comm.all_reduce(big).wait()
        comm.all_reduce(small).wait()
        comm.process_group().allreduce([lent]).wait()
        return [big, small, lent, comm._shm.finished]

    results = in_threads(comms, work)
    for big, small, lent, through_shm in results:
        assert torch.equal(big, torch.full((2000,), 3.0)) and torch.equal(small, torch.full((4,), 3.0))
        assert torch.equal(lent, torch.full((1500,), 3.0))
        assert through_shm == 1  # the small one alone
    close(comms)


def test_an_op_shared_memory_does_not_implement_is_refused_never_another():
    """`prod` is not in the table: the launch raises CommError (it used to reduce as MIN)."""
    comms = group(2, "shm-prod")
    results = in_threads(comms, lambda r, c: c._shm.launch(torch.tensor([1.0, 5.0]) if r == 0 else torch.tensor([2.0, 7.0]),
                                                           "prod", 5.0, lambda: False, c.name))
    assert all(isinstance(e, CommError) and "no reduce op 'prod'" in str(e) for e in results), results
    close(comms)


def test_the_process_group_honours_the_reduce_op_it_is_given():
    """torch's view of the group (`process_group()`) reduces with the op of its options: MAX through
    shared memory, PRODUCT (which shared memory does not implement) through gloo; it used to sum both."""
    comms = group(2, "shm-pg-ops")

    def work(r: int, comm) -> list[torch.Tensor]:
        out = []
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
            opts = dist.AllreduceOptions()
            opts.reduceOp = op  # type: ignore[assignment]  # pybind converts a RedOpType
            t = torch.tensor([1.0, 5.0]) if r == 0 else torch.tensor([2.0, 7.0])
            comm.process_group().allreduce([t], opts).wait()
            out.append(t)
        return out

    for maximum, product in in_threads(comms, work):
        assert torch.equal(maximum, torch.tensor([2.0, 7.0])) and torch.equal(product, torch.tensor([2.0, 35.0]))
    close(comms)


def test_tensors_gloo_takes_are_taken_as_gloo_takes_them():
    """A tensor that requires grad is reduced in place outside autograd (gloo returns the sum), an empty
    one completes at once, and the group stays usable after both."""
    comms = group(2, "shm-grad-empty")

    def work(r: int, comm) -> list:
        leaf = torch.full((3,), float(r + 1), requires_grad=True)
        comm.all_reduce(leaf).wait()
        empty = torch.empty(0)
        comm.all_reduce(empty).wait()
        after = torch.full((2,), float(r + 1))
        comm.all_reduce(after).wait()
        return [leaf.detach(), after, comm.failed]

    for leaf, after, failed in in_threads(comms, work):
        assert torch.equal(leaf, torch.full((3,), 3.0)) and torch.equal(after, torch.full((2,), 3.0)) and not failed
    close(comms)


def test_any_other_failure_of_an_operation_is_a_comm_error_that_fails_the_group():
    """MAX of complex numbers is undefined (torch raises): the wait raises CommError, not the raw error,
    and the group is marked failed (never used again)."""
    comms = group(2, "shm-complex")
    results = in_threads(comms, lambda r, c: c.all_reduce(torch.ones(2, dtype=torch.complex64), "max").wait())
    assert all(isinstance(e, CommError) for e in results), results
    assert all(c.failed for c in comms)
    close(comms)


PEER = """
import os, sys
from actors.transport.comm import GroupSpec, make_communicator
port, name, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
comm = make_communicator(GroupSpec("127.0.0.1", port, name, 1, 2, 30.0, "gloo", "127.0.0.1"))
print(comm.shared_memory, comm.shm_fallback, flush=True)
if mode == "sum":
    import torch
    t = torch.full((4,), 2.0)
    comm.all_reduce(t).wait()
    print(t.tolist(), flush=True)
os._exit(0)
"""


def _with_peer_process(name: str, mode: str, prefix: list[str] | None = None) -> tuple:
    """Rank 0 in a thread here, rank 1 in a child process (its command under `prefix`), over a TCP store."""
    store, port, sock = serve_store("127.0.0.1", 30.0)
    child = subprocess.Popen([*(prefix or []), sys.executable, "-c", PEER, str(port), name, mode], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    comm = make_communicator(GroupSpec("127.0.0.1", port, name, 0, 2, 30.0, "gloo", "127.0.0.1"))
    return comm, child, (store, sock)


def test_a_peer_that_died_unreaped_fails_the_wait_at_once():
    """Rank 1, a child process, exits after the group formed and is not reaped (a zombie, whose process
    id still answers): the survivor's wait fails with CommError within a few checks, not after the
    group's 30 s timeout (its lock on its file went with its descriptors)."""
    comm, child, keep = _with_peer_process("shm-zombie", "exit")
    try:
        assert comm.shared_memory, child.stderr.read() if child.stderr else ""
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        began = time.monotonic()
        with pytest.raises(CommError, match="rank 1 .* is gone"):
            comm.all_reduce(torch.ones(4)).wait()
        assert time.monotonic() - began < 10.0  # the timeout is 30 s; the check runs every CHECK_S
    finally:
        child.wait()
        comm.close()


ROOT_NAMESPACES = os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("mount") is not None


def _own_dev_shm(size: str) -> list[str]:
    """A command prefix: the rest runs in a mount namespace of its own with a `size` tmpfs on /dev/shm."""
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "own-dev-shm"]


@pytest.mark.skipif(not ROOT_NAMESPACES, reason="needs root and unshare(1) to give a process its own /dev/shm")
def test_a_peer_with_its_own_dev_shm_on_the_same_address_keeps_gloo():
    """Containers with host networking: rank 1 runs in a mount namespace with its own /dev/shm, on the
    same address. Both keep gloo, saying that /dev/shm differs, and the sum is right."""
    comm, child, keep = _with_peer_process("shm-namespaces", "sum", _own_dev_shm("16m"))
    try:
        t = torch.full((4,), 1.0)
        comm.all_reduce(t).wait()
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert not comm.shared_memory and "do not share one /dev/shm" in (comm.shm_fallback or "")
        assert out.splitlines()[0].startswith("False shared memory unavailable") and "do not share one /dev/shm" in out
        assert torch.equal(t, torch.full((4,), 3.0)) and out.splitlines()[1] == "[3.0, 3.0, 3.0, 3.0]"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        comm.close()


SMALL_DEV_SHM = """
import torch
from actors.transport.comm import in_process_group
from actors.transport.comm import GroupSpec, in_process_store, make_communicator
from concurrent.futures import ThreadPoolExecutor
host, port = in_process_store()
specs = [GroupSpec(host, port, "shm-full", r, 2, 10.0, "gloo", "127.0.0.1", reduce_bytes=2**20) for r in range(2)]
with ThreadPoolExecutor(2) as pool:
    comms = list(pool.map(make_communicator, specs))
def run(r):
    out = []
    for k in range(3):
        t = torch.full((2**18,), float(r + 1))
        comms[r].all_reduce(t).wait()
        out.append(float(t.max()))
    return out
with ThreadPoolExecutor(2) as pool:
    results = list(pool.map(run, range(2)))
print([c.shared_memory for c in comms], results)
print(comms[0].shm_fallback)
"""


@pytest.mark.skipif(not ROOT_NAMESPACES, reason="needs root and unshare(1) to mount a small /dev/shm")
def test_a_dev_shm_too_small_for_the_group_makes_it_use_gloo_not_sigbus():
    """A 3 MiB /dev/shm (Docker's is 64 MiB) and a group of two whose slots take 2 MiB a member: the
    second member's reservation fails (ENOSPC) at formation, both keep gloo with a reason, and three
    1-MiB all-reduces are right. With the file only sized (not reserved) they died of SIGBUS instead."""
    result = subprocess.run([*_own_dev_shm("3m"), sys.executable, "-c", SMALL_DEV_SHM], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"rc {result.returncode}: {result.stderr[-2000:]}"
    lines = result.stdout.splitlines()
    assert lines[0] == "[False, False] [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]", result.stdout
    assert f"{os.strerror(errno.ENOSPC)}: /dev/shm (reserving 2.0 MiB)" in lines[1]
    assert "all-reduces through gloo" in lines[1]


def test_a_groups_slot_is_sized_from_its_spec():
    """Whole pages, at least one, at most `SLOT_BYTES`; a spec that does not say gets the unsized slot."""
    assert shm.slot_bytes(1) == 4096 and shm.slot_bytes(4097) == 8192
    assert shm.slot_bytes(10**12) == shm.SLOT_BYTES and shm.slot_bytes(0) == shm.UNSIZED_SLOT_BYTES


def test_offers_round_trip_and_decide_alike():
    """What a member publishes decodes to the same offer, and `obstacle` names what keeps the group off
    shared memory: a member without it (nothing to say), a refusal (its rank and reason), two nodes."""
    offer = shm.Offer("orchestrator-0123456789abcdef", 4096, "boot/1/2/3")
    refused = shm.Offer(refused="No space left on device: /dev/shm (reserving 2.0 MiB)")
    assert shm.Offer.decode(offer.encode()) == offer and shm.Offer.decode(refused.encode()) == refused
    assert shm.Offer.decode("") is None
    assert shm.obstacle([offer, offer]) is None
    assert shm.obstacle([offer, None]) == ""
    assert shm.obstacle([offer, refused]) == f"rank 1: {refused.refused}"
    assert shm.obstacle([refused, offer, refused]) == f"ranks 0, 2: {refused.refused}"
    assert "do not share one /dev/shm" in (shm.obstacle([offer, shm.Offer(offer.name, 4096, "boot/1/9/3")]) or "")


def test_rank_0_of_a_job_group_that_falls_back_tells_the_coordinator_why(tmp_path, monkeypatch):
    """Real replicas in threads (`LocalJob`) whose members do not share one /dev/shm (identities made
    distinct): the job trains through gloo, and rank 0 alone sends the reason, naming its group, to the
    coordinator (which records it as a `transport` event)."""
    from testkit.in_process import LocalJob

    real = shm.node_identity
    calls = iter(range(1000))
    monkeypatch.setattr(shm, "node_identity", lambda: f"{real()}-{next(calls)}")
    cfg = {"name": "fallback", "seed": 3, "workers": {"count": 2, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 8},
           "stop": {"max_steps": 3}, "eval_every": 0}
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 16)
    sent = [args for name, args in job.link.calls if name == "transport_fallback"]
    assert len(sent) == 1, job.link.calls
    slot, epoch, group_name, reason = sent[0]
    assert slot == "w0" and group_name in reason and "do not share one /dev/shm" in reason
