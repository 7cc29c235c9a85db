"""The digits MLP with one training sample that overflows float16 (its pixels times 1e5): under
`fp16-mixed` every step whose global batch holds it has a gradient that is not finite, however the batch
is split across members, and the steps without it stay far from fp16's range (the loss is scaled down by
1e3), so that a test knows which steps a loss scale must skip."""
from __future__ import annotations

import torch.nn.functional as F
from torch.utils.data import TensorDataset

from orchestrator.workloads import Workload, digits


def make(hidden: int = 16, poison: int = 0) -> Workload:
    workload = digits.mlp(hidden=hidden)
    x, y = workload.train_data.tensors
    x = x.clone()  # the digits' tensors are shared by every workload this process builds: poison a copy
    x[poison] *= 1e5
    workload.train_data = TensorDataset(x, y)
    workload.loss = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]) * 1e-3
    return workload
