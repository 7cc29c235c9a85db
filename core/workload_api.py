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

from collections.abc import Callable, Mapping
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
    collate_fn: Callable[[list[Any]], Any] | None = None
    """A member's share of a step's samples (a list, in order) to the batch `loss` takes, in place of torch's
    `default_collate`: padding ragged rows, encoding strings. Then the samples' layouts are not checked
    against each other, and a Ray Data share reaches it as one dict per row (string columns as stored)."""


Sums = Mapping[str, tuple[float, float]]
"""Each metric's total over the data it saw and the weight it is a mean over: {name: (total, weight)}."""


@dataclass(frozen=True)
class MeanEvaluation:
    """An `evaluate` whose metrics are means over the evaluation data (a loss per token, an accuracy per
    sample). `sums(model, data)` returns each metric's total and weight ({name: (total, weight)}: the
    weight is what the mean is over, samples or tokens); `derived(means)` adds metrics computed from the
    means (a perplexity from a loss). The members of a policy that keeps them in lockstep (bsp and the
    other synchronous policies) evaluate shares of `eval_data` side by side, and the project sums the
    totals and the weights over them, so the mean is the one over all of the data, whatever the shares'
    sizes. Called as a plain `evaluate(model, data)`, it evaluates all of `data` in one process."""

    sums: Callable[[Any, Any], Sums]
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None

    def __call__(self, model: Any, data: Any) -> dict[str, float]:
        return self.finish(self.sums(model, data))

    def finish(self, sums: Sums) -> dict[str, float]:
        """The metrics from their totals and weights (over one share, or summed over all of them)."""
        means = {name: total / weight if weight else float("nan") for name, (total, weight) in sums.items()}
        return {**means, **(self.derived(means) if self.derived is not None else {})}
