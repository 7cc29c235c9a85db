"""The digits MLP with its training data in each form a workload may hand over (docs/data.md): a Hugging
Face `datasets.Dataset`, a Ray Data `Dataset`, a positioned stream, and a map-style dataset with
unreadable samples. Each sample carries its index as `id`; the model, the split and the evaluation are
those of `orchestrator.workloads.digits:mlp`, so every form trains the same samples the same way.

    factory: "orchestrator.workloads.digits_sources:mlp"
    params: {source: ray_data, blocks: 120}
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.workloads import Workload
from orchestrator.workloads.digits import _split
from orchestrator.workloads.digits import mlp as tensor_mlp

SOURCES = ("tensors", "datasets", "ray_data", "stream", "bad_samples", "plain_stream")


def dict_cross_entropy(model: nn.Module, batch: dict) -> torch.Tensor:
    p = next(model.parameters())
    logits = model(batch["x"].to(device=p.device, dtype=p.dtype))
    return F.cross_entropy(logits, batch["y"].to(logits.device))


class DigitsStream(torch.utils.data.IterableDataset):
    """The training split as a stream that can be positioned (the `state_dict`/`load_state_dict` contract
    of docs/data.md): one pass is a data epoch, in a fixed order. `positioned=False` leaves out
    `load_state_dict`'s effect (the stream always starts over), which the tests use to show what a
    stream that cannot be positioned would do."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, positioned: bool = True) -> None:
        self.x, self.y, self.positioned = x, y, positioned
        self.position = 0

    def __iter__(self):
        while self.position < len(self.x):
            i = self.position
            self.position += 1
            yield {"id": i, "x": self.x[i], "y": self.y[i]}
        self.position = 0  # the next pass is the next data epoch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if self.positioned:
            self.position = int(state["position"])


class PlainStream(torch.utils.data.IterableDataset):
    """The training split as a stream that cannot be positioned (no `state_dict`): refused."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(len(self.x)):
            yield {"id": i, "x": self.x[i], "y": self.y[i]}


class BadSamples(torch.utils.data.Dataset):
    """The training split, except that reading sample i for i in `bad` raises."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, bad: list[int]) -> None:
        self.x, self.y, self.bad = x, y, set(bad)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i in self.bad:
            raise ValueError(f"corrupt record {i}")
        return self.x[i], self.y[i]


def mlp(source: str = "tensors", hidden: int = 32, blocks: int = 120, bad: list[int] | None = None,
        positioned: bool = True, limit: int | None = None) -> Workload:
    """`source`: tensors (a TensorDataset), datasets (Hugging Face), ray_data (`blocks` blocks), stream,
    bad_samples (a map-style dataset whose samples `bad` raise), plain_stream (a stream without
    `state_dict`, which the orchestrator refuses). `limit`: train on the first `limit`
    samples of the split only (a short data epoch)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}; got {source!r}")
    workload = tensor_mlp(hidden=hidden)
    x, y, _, _ = _split()
    x, y = x[:limit], y[:limit]
    data: Any
    if source == "datasets":
        import datasets

        data = datasets.Dataset.from_dict({"id": np.arange(len(x)), "x": x.numpy(), "y": y.numpy()}).with_format("torch")
    elif source == "ray_data":
        import ray.data

        data = ray.data.from_items([{"id": i, "x": x[i].numpy(), "y": int(y[i])} for i in range(len(x))],
                                   override_num_blocks=blocks)
    elif source == "stream":
        data = DigitsStream(x, y, positioned)
    elif source == "plain_stream":
        data = PlainStream(x, y)
    elif source == "bad_samples":
        data = BadSamples(x, y, bad or [])
    else:
        data = torch.utils.data.TensorDataset(x, y)
    workload.train_data = data
    if source not in ("bad_samples", "tensors"):
        workload.loss = dict_cross_entropy
    return workload
