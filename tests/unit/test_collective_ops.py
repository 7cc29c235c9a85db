"""`ray.util.collective`'s operations on a membership epoch's group (actors/transport/collective.py), over an
in-process gloo group of three: a reduce-scatter is a real one (each rank sends (n-1) outputs' worth of bytes;
the all-reduce of the concatenated chunks it replaced sent twice that), NumPy arrays work in place, and a value
of another type is refused with a TypeError before anything is launched, leaving the group usable. Staging a CPU
tensor onto an NCCL group's GPU and back needs a GPU: tests/gpu/test_gpu.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from actors.transport import collective
from testkit.harness import local_group

pytest.importorskip("ray.util.collective")


def run_ranks(world: int, body) -> dict[int, object]:
    comms = local_group(world, name=f"col-ops-{id(body)}", timeout_s=10.0)
    cls = collective._backend_class()
    groups = []
    try:
        for comm in comms:  # one process holds every rank here: each group takes its rank's communicator as made
            collective._live[comm.name] = comm
            groups.append(cls(world, comm.rank, comm.name))
        out: dict[int, object] = {}
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, body(groups[r], comms[r]))) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out
    finally:
        collective._live.pop(comms[0].name, None)
        for comm in comms:
            comm.close()


def test_reducescatter_gives_each_rank_the_sum_of_its_chunk_and_sends_a_reduce_scatters_bytes():
    world, size = 3, 4

    def body(group, comm):
        r = comm.rank
        chunks = [torch.full((size,), float(10 * r + k)) for k in range(world)]
        out = torch.zeros(size)
        group.reducescatter([out], [chunks])
        return out.tolist(), comm.bytes_sent
    got = run_ranks(world, body)
    for r in range(world):
        values, sent = got[r]
        assert values == [float(sum(10 * q + r for q in range(world)))] * size
        assert sent == (world - 1) * size * 4, f"rank {r} sent {sent} bytes"


def test_numpy_arrays_reduce_in_place_and_a_value_of_another_type_leaves_the_group_usable():
    def body(group, comm):
        arr = np.ones(3, dtype=np.float32) * (comm.rank + 1)
        group.allreduce([arr])
        with pytest.raises(TypeError, match="takes torch tensors and numpy arrays, not list"):
            group.allreduce([[1.0, 2.0]])
        after = torch.ones(2)
        group.allreduce([after])
        return arr.tolist(), comm.failed, after.tolist()
    got = run_ranks(2, body)
    assert got == {r: ([3.0, 3.0, 3.0], False, [2.0, 2.0]) for r in range(2)}
