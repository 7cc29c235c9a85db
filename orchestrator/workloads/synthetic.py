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


class SlowItems(torch.utils.data.Dataset):
    """A dataset whose every sample waits `item_s` before it is returned, as a read from a disk or a
    network (or decoding in a library that releases the GIL) would; `busy`: computes in Python for
    `item_s` instead, holding the GIL, as pure-Python decoding does."""

    def __init__(self, data: TensorDataset, item_s: float, busy: bool = False) -> None:
        self.data, self.item_s, self.busy = data, item_s, busy

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        import time

        if self.busy:
            until = time.perf_counter() + self.item_s
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(self.item_s)
        return self.data[index]


def slow_loading(item_ms: float = 2.5, compute_ms: float = 20.0, width: int = 64, features: int = 64,
                 samples: int = 4096, seed: int = 0, busy: bool = False) -> Workload:
    """The synthetic MLP with a loading cost (`item_ms` a sample; `busy`: Python computing, holding the
    GIL, instead of waiting) and a modelled compute (`compute_ms` a step), for benchmarks/loading.py:
    batch 8 at 2.5 ms a sample loads for as long as it computes."""
    from orchestrator.workloads import with_modelled_compute

    work = mlp(width=width, depth=1, features=features, classes=8, samples=samples, seed=seed)
    if not isinstance(work.train_data, TensorDataset):
        raise TypeError(f"mlp's train_data is a TensorDataset, not {type(work.train_data).__name__}")
    work.train_data = SlowItems(work.train_data, item_ms / 1000.0, busy)
    return with_modelled_compute(work, compute_ms=compute_ms)
