"""A user workload whose loss calls `ray.util.collective` on its membership epoch's group.

Each loss call all-reduces a tensor holding 1 and this rank's number over the group named by
`orchestrator.collective_group()` and appends `group rank world_size sum_of_ones sum_of_ranks` to
`<log_dir>/<slot>.txt`, so a test can check every call against the group it ran in. The loss itself
is the blobs classifier's (tests/workloads/custom_workload.py).
"""
from __future__ import annotations

import os

import ray.util.collective as col
import torch
from custom_workload import Blobs

from orchestrator import collective_group


class CollectiveBlobs(Blobs):
    def __init__(self, log_dir: str) -> None:
        super().__init__(1200, 0, "")
        self.log_dir = log_dir

    def loss(self, model, batch):
        name = collective_group()
        rank, world = col.get_rank(name), col.get_collective_group_size(name)
        t = torch.tensor([1.0, float(rank)])
        col.allreduce(t, group_name=name)
        with open(os.path.join(self.log_dir, f"{os.environ['ORCHESTRATOR_SLOT']}.txt"), "a", encoding="utf-8") as f:
            f.write(f"{name} {rank} {world} {t[0]:.0f} {t[1]:.0f}\n")
        return super().loss(model, batch)


def make(log_dir: str) -> CollectiveBlobs:
    return CollectiveBlobs(log_dir)
