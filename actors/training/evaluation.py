"""The workload's evaluation of a member's model: on one member over all of `eval_data`, or, for a
`MeanEvaluation` under a policy whose members are in lockstep, split across the members.

Split: at an evaluation step every member of the plan holds the same committed model; member r of W
evaluates the r-th of W contiguous shares of `eval_data` (their sizes differ by at most one), and one
all-reduce of each metric's total and weight over the epoch's group gives every member the mean over
all of the data. The sum of the totals over the sum of the weights is the mean over the whole set,
exactly (up to float64 rounding), whatever the shares' sizes; a mean of the members' means would not be.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.data import Subset, TensorDataset

from actors.training.epoch_group import Reducing
from actors.training.user_code import call, contract, metrics_of
from algorithms.policies.base import AlgorithmImpl
from algorithms.rules.kinds import Kind
from core.workload_api import MeanEvaluation, Sums


class Evaluation:
    """A member's evaluations of its model (the replicas' average, where the policy keeps one)."""

    def __init__(self, workload: Any, device: torch.device) -> None:
        self._evaluate: Any = getattr(workload, "evaluate", None)
        self._data: Any = getattr(workload, "eval_data", None)
        self._device = device
        self._eval_model: torch.nn.Module | None = None
        """A copy of the model that holds the replicas' average (the policies that keep one)."""

    @property
    def offered(self) -> bool:
        """Whether the workload evaluates at all (an `evaluate` and its `eval_data`)."""
        return self._evaluate is not None and self._data is not None

    def splits(self, kind: Kind, impl: AlgorithmImpl, world: int) -> bool:
        """Whether this evaluation is split across the `world` members: a `MeanEvaluation`, a kind whose
        members are in lockstep at every step (each commits the same step with the same model), no
        average to evaluate instead, and at least one item of the data for each member."""
        return (self.offered and isinstance(self._evaluate, MeanEvaluation) and kind.reduces_every_step and world > 1
                and impl.eval_parameters() is None and len(self._data) >= world)

    def whole(self, model: torch.nn.Module, impl: AlgorithmImpl, step: int) -> dict:
        """{"metrics": ...} of the model over all of the data, in this member alone; {} without an evaluation."""
        if not self.offered:
            return {}
        flat = impl.eval_parameters()
        if flat is not None:  # the replicas' average, on a copy of the model
            if self._eval_model is None:
                self._eval_model = copy.deepcopy(model)
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat.to(self._device),
                                                    [p for p in self._eval_model.parameters() if p.requires_grad])
            model = self._eval_model
        return {"metrics": metrics_of(self._evaluate, model, self._data, step)}

    def in_shares(self, model: torch.nn.Module, rank: int, world: int, comm: Reducing, step: int) -> dict:
        """{"metrics": ...} over all of the data, this member having evaluated its share: every member of
        the group calls it at the same step (one all-reduce; a `CommError` where the group fails)."""
        evaluate = self._evaluate
        assert isinstance(evaluate, MeanEvaluation)
        size = len(self._data)
        share = _share(self._data, rank * size // world, (rank + 1) * size // world)
        sums = _checked_sums(evaluate, model, share, step)
        names = sorted(sums)
        flat = torch.tensor([float(v) for name in names for v in sums[name]], dtype=torch.float64, device=comm.device)
        comm.all_reduce(flat, "sum").wait()
        values = flat.tolist()
        return {"metrics": evaluate.finish({name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(names)})}


def _share(data: Any, start: int, stop: int) -> Any:
    """Items [start, stop) of `data`: a TensorDataset as one (its workload's evaluate may read its
    tensors), any other map-style dataset as a `Subset`."""
    if isinstance(data, TensorDataset):
        return TensorDataset(*(t[start:stop] for t in data.tensors))
    return Subset(data, range(start, stop))


def _checked_sums(evaluate: MeanEvaluation, model: torch.nn.Module, data: Any, step: int) -> Sums:
    """`evaluate.sums(model, data)` as {name: (total, weight)}; a WorkloadBug for what it raises or returns
    in another shape."""
    returned = call("evaluate", evaluate.sums, model, data, step=step)
    with contract("evaluate", evaluate.sums, step):
        if not isinstance(returned, dict) or not all(isinstance(v, tuple) and len(v) == 2 for v in returned.values()):
            raise TypeError("a MeanEvaluation's sums returned something other than {name: (total, weight)}")
        return {str(name): (float(total), float(weight)) for name, (total, weight) in returned.items()}
