"""Point-to-point exchanges as one operation (`Communicator.exchange`), so that a ring of sends cannot
deadlock on NCCL, and the hierarchical all-reduce kept off NCCL.

On NCCL, sends and receives issued one by one run in order on the communicator's one stream: a rank's send
waits for its peer's receive, which is queued behind the peer's own send, and a ring deadlocks (gloo buffers
sends, so it never showed here). The gossip policies and the hierarchical leaders' ring now launch each
exchange's sends and receives together; NCCL groups them (ncclGroupStart/End, as torch's `batch_isend_irecv`).
What a CPU shows: the gossip steps issue no send or receive on their own (a ring of four and five, the
literal-W oracle still holding), an exchange over in-process gloo delivers each message and fails as one
operation, NCCL's grouping brackets every call of the exchange, and a hierarchical all-reduce is refused on
NCCL at config time and is never a candidate of `auto` there."""
from __future__ import annotations

import threading

import pytest
import torch

from actors.transport.base import TorchBackendCommunicator
from actors.transport.nccl import NcclCommunicator
from core.comm_api import CommError
from core.schema import ConfigError
from orchestrator.config import config_from_dict
from orchestrator.planning.candidates import candidates
from testkit.harness import local_group
from tests.unit.test_gossip import SGD, reference_gossip, run_gossip
from tests.unit.test_policy_oracles import max_diff


@pytest.mark.parametrize("n", [4, 5])
def test_gossip_steps_send_and_receive_only_through_one_exchange(tmp_path, monkeypatch, n):
    exchanges: list[tuple[int, int]] = []
    real = TorchBackendCommunicator.exchange

    def one_by_one(self, *args, **kwargs):
        raise AssertionError("a send or receive issued on its own: on NCCL a ring of them deadlocks")

    def recorded(self, sends, recvs):
        exchanges.append((len(sends), len(recvs)))
        return real(self, sends, recvs)
    monkeypatch.setattr(TorchBackendCommunicator, "send", one_by_one)
    monkeypatch.setattr(TorchBackendCommunicator, "recv", one_by_one)
    monkeypatch.setattr(TorchBackendCommunicator, "exchange", recorded)
    mine = run_gossip(tmp_path, {"policy": "dpsgd", "topology": {"kind": "ring"}}, SGD, n, 10 * n)
    ref = reference_gossip("ring", SGD, n, 10 * n)
    assert max(max_diff(a, b) for a, b in zip(mine, ref)) < 1e-5
    assert exchanges and set(exchanges) == {(2, 2)}, exchanges  # each member: both neighbours, at once


def _run(world: int, body):
    """`body(comm)` in one thread per rank of an in-process gloo group; the results by rank."""
    out: dict[int, object] = {}
    comms = local_group(world, timeout_s=10.0)
    try:
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, body(comms[r]))) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for comm in comms:
            comm.close()
    return out


def test_an_exchange_over_gloo_delivers_each_message_and_counts_what_it_sent():
    world = 4

    def ring(comm):
        rank = comm.rank
        mine = torch.full((3,), float(rank))
        left, right = torch.empty(3), torch.empty(3)
        comm.exchange([(mine, (rank + 1) % world), (mine, (rank - 1) % world)],
                      [(left, (rank - 1) % world), (right, (rank + 1) % world)]).wait()
        return float(left[0]), float(right[0]), comm.bytes_sent
    out = _run(world, ring)
    assert out == {r: (float((r - 1) % world), float((r + 1) % world), 2 * 3 * 4) for r in range(world)}


def test_an_exchange_whose_peer_never_sends_fails_as_one_operation():
    def lopsided(comm):
        if comm.rank == 1:
            return "silent"
        try:
            comm.exchange([], [(torch.empty(2), 1)]).wait(timeout=2.0)
        except CommError as err:
            return type(err).__name__
        return "completed"
    assert _run(2, lopsided)[0] == "CommTimeout"


class _RecordingPG:
    """NCCL's backend as the exchange calls it: the order of its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _start_coalescing(self, device):
        self.calls.append("start")

    def _end_coalescing(self, device):
        self.calls.append("end")
        return "the group's work"

    def send(self, tensors, dst, tag):
        self.calls.append(f"send {dst}")

    def recv(self, tensors, src, tag):
        self.calls.append(f"recv {src}")


def test_on_nccl_every_call_of_an_exchange_is_inside_one_group():
    class Stub:
        device = torch.device("cpu")
        _pg = _RecordingPG()
        submitted: list = []

        def _submit(self, launch, keep):
            self.submitted.append(launch())
            return "handle"
    stub = Stub()
    launch = lambda: [stub._pg.send([None], 1, 0), stub._pg.send([None], 3, 0), stub._pg.recv([None], 3, 0),  # noqa: E731
                      stub._pg.recv([None], 1, 0)]
    assert NcclCommunicator._submit_exchange(stub, launch, ()) == "handle"
    assert stub._pg.calls == ["start", "send 1", "send 3", "recv 3", "recv 1", "end"]
    assert stub.submitted == ["the group's work"]


BASE = {"name": "hier", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 5},
        "sync": {"policy": "bsp", "hierarchical": True}}


def test_a_hierarchical_all_reduce_is_refused_on_nccl_and_runs_on_gloo():
    with pytest.raises(ConfigError) as refused:
        config_from_dict({**BASE, "workers": {"count": 2, "gpus": 1}})
    assert str(refused.value).startswith("sync.hierarchical:") and "\n" not in str(refused.value)
    assert config_from_dict({**BASE, "workers": {"count": 2, "gpus": 1}, "comm": {"backend": "gloo"}}).group_backend == "gloo"
    assert config_from_dict(BASE).group_backend == "gloo"


def test_auto_offers_hierarchical_variants_across_nodes_on_gloo_only():
    plain = {"name": "auto", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 5}}
    on_gloo = [c.label for c in candidates(config_from_dict(plain), nodes=2)]
    on_nccl = [c.label for c in candidates(config_from_dict({**plain, "workers": {"count": 2, "gpus": 1}}), nodes=2)]
    assert any("hierarchical" in label for label in on_gloo)
    assert not any("hierarchical" in label for label in on_nccl) and on_nccl
