"""A collective that outlives the group's timeout fails as a timeout, whichever deadline passes first:
the wait's own (counted from the call to `wait`) or the backend's (gloo's, counted from the launch)."""
from __future__ import annotations

import time

import pytest
import torch

from actors.transport.comm import CommError, CommTimeout
from testkit.harness import local_group

TIMEOUT_S = 0.5


def test_gloo_timing_out_before_the_wait_begins_is_a_timeout(monkeypatch):
    """Rank 1 never enters the all-reduce; rank 0 waits only after gloo's own deadline has passed, so
    the operation is already finished (failed, "Timed out waiting 500ms for recv ...") when the wait
    starts: that is a timeout, not some other failure (the comm test of a silent peer saw CommError
    from a survivor whose wait began 0.1 s after its launch on a loaded machine). Through gloo (in one
    process the group would all-reduce through shared memory, which has no deadline of its own)."""
    monkeypatch.setenv("ORCHESTRATOR_SHM", "0")
    comms = local_group(2, timeout_s=TIMEOUT_S)
    handle = comms[0].all_reduce(torch.ones(1000))
    deadline = time.monotonic() + 30
    while not handle.is_completed():  # gloo's own deadline passes first; the wait begins after it
        assert time.monotonic() < deadline, "gloo's 0.5-s deadline never ended the operation"
        time.sleep(0.05)
    try:
        handle.wait()
    except CommError as err:
        print(type(err).__name__, err)
        assert isinstance(err, CommTimeout), f"{type(err).__name__}: {err}"
    else:
        raise AssertionError("the all-reduce with an absent peer finished")


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared memory", "gloo"])
def test_the_waits_own_deadline_is_a_timeout(monkeypatch, shm):
    """The group's deadline is 60 s: a wait that ends within 30 s was ended by its own 0.3-s deadline."""
    monkeypatch.setenv("ORCHESTRATOR_SHM", shm)
    comms = local_group(2, timeout_s=60.0)
    assert getattr(comms[0], "shared_memory", False) == (shm == "1")
    handle = comms[0].all_reduce(torch.ones(1000))
    started = time.monotonic()
    try:
        handle.wait(timeout=0.3)
    except CommTimeout:
        assert 0.25 < time.monotonic() - started < 30.0
    else:
        raise AssertionError("the all-reduce with an absent peer finished")


def test_a_backend_timeout_outside_a_handle_is_a_timeout_too():
    """torch's gradient reducer runs gloo inside backward, outside any Handle; its errors reach the
    group through `failed_in_backend`, which tells a timeout from other failures the same way."""
    timed_out, reset = local_group(2, timeout_s=5.0)
    err = timed_out.failed_in_backend(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                                   "500ms for recv operation to complete"))
    assert isinstance(err, CommTimeout), f"{type(err).__name__}: {err}"
    err = reset.failed_in_backend(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert type(err) is CommError, f"{type(err).__name__}: {err}"


def test_an_abort_that_lands_while_an_operation_launches_still_releases_its_wait(monkeypatch):
    """The abort fails every pending wait at once; an operation launched as the abort lands (its launch
    past the aborted check, its handle not yet tracked when the abort looked at the pending ones) must
    not wait for the group's timeout (60 s here) instead. A shadow round abandoned as it launched its
    all-reduce waited so in a suite run. Through gloo (its launch is what the double replaces)."""
    import threading

    monkeypatch.setenv("ORCHESTRATOR_SHM", "0")
    comms = local_group(2, timeout_s=60.0)
    comm = comms[0]
    real = comm._pg

    class AbortedAsItLaunches:
        def allreduce(self, tensors, opts):
            comm.abort("a member died as the round launched")
            return real.allreduce(tensors, opts)

    comm._pg = AbortedAsItLaunches()
    handle = comm.all_reduce(torch.ones(1000))  # rank 1 never joins it
    outcome: list = []

    def wait() -> None:
        try:
            handle.wait()
            outcome.append("finished")
        except CommError as err:
            outcome.append(type(err).__name__)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(20)
    comm._pg = real
    assert outcome == ["CommAborted"], f"the wait is still blocked 20 s after the abort: {outcome}"


def test_an_abort_shuts_down_the_pair_it_checked_even_when_its_number_is_reused_meanwhile(monkeypatch):
    """`shut_down_pairs` (actors/transport/sockets.py) checks a descriptor's addresses and shuts it down
    through one duplicate: when the number is closed and taken by another socket of the process between
    the two (gloo closing a pair whose peer went away, Ray opening a connection), the pair is shut down
    and the other socket is not."""
    import os
    import socket

    from actors.transport import sockets

    peer_listener, other_listener = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    pair = socket.create_connection(peer_listener.getsockname()[:2])
    pair_far, _ = peer_listener.accept()
    other = socket.create_connection(other_listener.getsockname()[:2])
    other_far, _ = other_listener.accept()
    number = pair.fileno()
    real_dup = os.dup
    kept = real_dup(number)  # the pair's socket stays open after its number is taken
    reused = []

    def dup(fd: int) -> int:
        out = real_dup(fd)
        if fd == number and not reused:  # right after the first duplicate, the number names another socket
            os.dup2(other.fileno(), number)
            reused.append(True)
        return out
    monkeypatch.setattr(sockets, "_socket_fds", lambda: {number: "socket:[pair]"})
    monkeypatch.setattr(sockets.os, "dup", dup)
    try:
        shut = sockets.shut_down_pairs(("127.0.0.1", 1), {peer_listener.getsockname()[:2]})
        monkeypatch.undo()
        assert reused and shut == 1
        pair_far.settimeout(5)
        assert pair_far.recv(1) == b"", "the pair was not shut down"
        other.sendall(b"x")
        other_far.settimeout(5)
        assert other_far.recv(1) == b"x", "the socket that took the pair's number was shut down"
    finally:
        os.close(kept)
        for s in (pair, pair_far, other, other_far, peer_listener, other_listener):
            s.close()


def test_nccls_own_timeouts_are_timeouts():
    """The texts torch's NCCL group raises when its deadline passes, as an H200 gave them on
    2026-11-27 (the GPU tier's peer-never-arrives test got a CommError, not a CommTimeout, from the
    first): the non-blocking communicator's and the watchdog's. Other NCCL errors stay CommError."""
    from actors.transport.base import backend_error

    for text in ("NCCL timeout in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:197",
                 "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
                 "NumelIn=4, NumelOut=4, Timeout(ms)=13000) ran for 13001 milliseconds before timing out."):
        err = backend_error("lonely", RuntimeError(text), "NCCL")
        assert isinstance(err, CommTimeout), f"{type(err).__name__}: {err}"
        assert str(err).startswith("group lonely: NCCL: ")
    err = backend_error("lonely", RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error"), "NCCL")
    assert type(err) is CommError, f"{type(err).__name__}: {err}"
