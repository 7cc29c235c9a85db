"""Built-in workloads and the contract every workload meets.

A workload factory is called as `factory(**workload.params)` and returns an object with
`model`, `train_data` (a map-style torch dataset), optionally `eval_data`,
`loss(model, batch) -> Tensor` and optionally `evaluate(model, eval_data) -> dict` and
`tokens_per_sample` (a sequence model's tokens in one sample: progress, status, history and the
metrics then show tokens per second).
`Workload` below is a convenient container for that; any object with those attributes works.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Workload:
    model: torch.nn.Module
    train_data: torch.utils.data.Dataset
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    eval_data: torch.utils.data.Dataset | None = None
    evaluate: Callable[[torch.nn.Module, Any], dict] | None = None
    tokens_per_sample: int | None = None
