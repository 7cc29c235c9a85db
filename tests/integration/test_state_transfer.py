"""A committed state sent to a joiner in chunks (actors/training/state_transfer.py): what it delivers, and what
it costs each member in memory.

In process: a nested state (an ordered dict with its `_metadata`, tuples, bf16, bool, 0-dim, empty and
non-contiguous tensors) reaches every receiver equal, through chunks far smaller than its tensors; a member that
keeps its own state and the source get nothing back. Across processes (the mechanism is the processes' memory):
three members of a gloo group, each holding a 64-MiB state as a live model would; the source sends it, one
member keeps its own, one receives it. Each one's peak resident memory may grow by the chunk (4 MiB) plus a
slack of 24 MiB, and the receiver's by the state itself too. The whole-state buffer this replaced grew the
source by twice the state (its bytes and a bytearray of them), the keeper by the state and the receiver by three
times it; with the chunk as large as the state (the mechanism switched off), the source and the keeper exceed
their bound."""
from __future__ import annotations

import collections
import multiprocessing as mp
import resource
import threading

import torch

from actors.training.state_transfer import broadcast_state, join_tensors, split_tensors
from testkit.harness import local_group

MIB = 2 ** 20


def nested_state() -> dict:
    model = collections.OrderedDict(w=torch.randn(33, 17), b=torch.arange(5, dtype=torch.bfloat16))
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {"model": model, "optimizer": {"state": {0: {"step": torch.tensor(7.0), "m": torch.randn(17, 33).t()}},
                                          "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
            "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 4), "pair": (torch.ones(2), 3),
            "step": 12, "name": "w0"}


def test_split_and_join_keep_every_container_and_value():
    state = nested_state()
    skeleton, tensors = split_tensors(state)
    assert len(tensors) == 7 and not any(isinstance(v, torch.Tensor) for v in skeleton.values())
    again = join_tensors(skeleton, tensors)
    assert type(again["model"]) is collections.OrderedDict and again["model"]._metadata == {"": {"version": 1}}
    assert isinstance(again["pair"], tuple) and again["pair"][1] == 3 and again["step"] == 12


def test_every_receiver_gets_the_state_equal_through_small_chunks():
    state = nested_state()
    comms = local_group(4, timeout_s=10.0)
    out: dict[int, object] = {}

    def member(rank: int) -> None:
        mine = state if rank == 1 else None
        out[rank] = broadcast_state(comms[rank], 1, mine, keep=rank == 3, chunk_bytes=100)
    threads = [threading.Thread(target=member, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for comm in comms:
        comm.close()
    assert out[1] is None and out[3] is None  # the source, and a member that keeps its own
    for rank in (0, 2):
        got = out[rank]
        assert isinstance(got, dict) and got["step"] == 12 and got["model"]._metadata == {"": {"version": 1}}
        _, sent = split_tensors(state)
        _, received = split_tensors(got)
        assert [(t.dtype, t.shape) for t in received] == [(t.dtype, t.shape) for t in sent]
        assert all(torch.equal(a, b) for a, b in zip(received, sent))


def _member(rank: int, port: int, chunk: int, out) -> None:
    from actors.transport.comm import make_communicator
    from core.comm_api import GroupSpec

    torch.manual_seed(rank)
    live = {f"layer{i}": torch.randn(2 * MIB) for i in range(8)}  # 64 MiB, held as a live model holds it
    comm = make_communicator(GroupSpec("127.0.0.1", port, "transfer", rank, 3, 60.0))
    comm.broadcast(torch.zeros(1), 0).wait()  # formed, and first used, before the measure
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = broadcast_state(comm, 0, {"model": live} if rank == 0 else None, keep=rank == 1, chunk_bytes=chunk)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    equal = True
    if got is not None:  # after the measure: the source's tensors, drawn again from its seed
        torch.manual_seed(0)
        equal = all(torch.equal(got["model"][f"layer{i}"], torch.randn(2 * MIB)) for i in range(8))
    out.put((rank, grown, got is not None, equal))
    comm.close()


def _peak_growth(chunk: int) -> dict[int, tuple[int, bool]]:
    from actors.transport.store import serve_store

    store, port, sock = serve_store("127.0.0.1", 60.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, chunk, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, grown, received, equal = out.get(timeout=120)
        assert equal, f"rank {rank} received another state"
        results[rank] = (grown, received)
    for p in procs:
        p.join(60)
    sock.close()
    del store
    return results


def test_a_transfer_grows_each_member_by_a_chunk_and_the_receiver_by_the_state():
    state, chunk, slack = 64 * MIB, 4 * MIB, 24 * MIB
    grown = _peak_growth(chunk)
    print("peak resident growth (MiB): " + ", ".join(f"{role} {grown[r][0] / MIB:.1f}" for r, role in
                                                      ((0, "source"), (1, "keeper"), (2, "receiver"))))
    assert [grown[r][1] for r in range(3)] == [False, False, True]
    assert grown[0][0] <= chunk + slack and grown[1][0] <= chunk + slack
    assert grown[2][0] <= state + chunk + slack
