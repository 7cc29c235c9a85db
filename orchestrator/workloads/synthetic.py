"""A synthetic classification workload for benchmarks: a wide MLP on data drawn with a fixed seed.

The labels come from a hidden random linear teacher, so there is something to learn; the model's
size and step time are set by `width`, `depth` and the batch size, independently of any data set.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from orchestrator.workloads import Workload


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp(width: int = 1024, depth: int = 4, features: int = 256, classes: int = 16, samples: int = 65536,
        seed: int = 0) -> Workload:
    """`depth` hidden layers of `width` units on `samples` points of `features` dimensions."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    y = (x @ teacher).argmax(1)
    layers: list[nn.Module] = []
    size = features
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, classes))
    return Workload(model=nn.Sequential(*layers), train_data=TensorDataset(x, y), loss=_loss)
