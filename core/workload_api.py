"""The workload contract: what a workload factory returns and a worker consumes.

A factory (`workload.factory` in a config, called as `factory(**workload.params)`) returns an object
with `model` (a torch module), `train_data` (a map-style dataset with a length), `loss(model, batch)`
(a scalar tensor; or the loss with step metrics, `(loss, {name: number})` or `{"loss": loss, name:
number}`: docs/workloads.md), and optionally `eval_data`, `evaluate(model, eval_data) -> dict` and
`tokens_per_sample` (a sequence model's tokens in one sample: progress, status and the metrics then
show tokens per second) and `loss_tokens(batch)` (padded sequences: a step's loss is then the mean over
its loss tokens). `Workload` is a convenient container for it; any object with those
attributes works (`WorkloadLike` says which the worker requires). Torch is named for the type checker
only: this module loads none."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch


class MapData(Protocol):
    """A map-style dataset that knows its length (torch's `Dataset` declares no `__len__`)."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


class WorkloadLike(Protocol):
    """What a worker requires of a factory's answer (the optional attributes it reads with defaults)."""

    model: torch.nn.Module
    train_data: Any
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass
class Workload:
    model: torch.nn.Module
    train_data: torch.utils.data.Dataset
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    eval_data: torch.utils.data.Dataset | None = None
    evaluate: Callable[[torch.nn.Module, Any], dict] | None = None
    tokens_per_sample: int | None = None
    flops_per_token: float | None = None
    """Training FLOPs per token (a transformer's 6N + 12·L·d·T: orchestrator/workloads/flops.py): with it, and
    a device whose peak is known, history records each step's model FLOPs utilization (`mfu`)."""
    loss_tokens: Callable[[Any], int] | None = None
    """For padded sequences: how many tokens of a batch take a loss. With it, a step's loss is the mean
    over the global batch's loss tokens (each member's loss, the mean over its own, weighed by its share
    of them), not over its samples."""
