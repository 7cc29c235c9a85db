"""The workload's step metrics (the dict its loss may return beside the loss, `split_loss`): their names,
which size every vote that carries them, and each step's weighted sums of them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.training.user_code import contract


class StepMetrics:
    """The names of the step metrics and their sums over a step's micro-steps."""

    def __init__(self, resize_vote: Callable[[int, bool], None]) -> None:
        """`resize_vote(n, now)`: the policy's vote carries `n` metrics from now on (`now`: refit it inside
        the membership epoch; else the next epoch sizes it)."""
        self._resize_vote = resize_vote
        self.names: tuple[str, ...] = ()
        """The names of the step metrics the workload's loss returns (sorted): what the vote carries after
        the loss, and history records as `step_metrics`. Travels in the state."""
        self._settled = False
        """This process has trained a step: the metrics' names can no longer change."""

    def load(self, names: tuple[str, ...]) -> None:
        """A state's names (the next membership epoch sizes the vote for them)."""
        self.names = names
        self._resize_vote(len(names), False)

    def weighted(self, metrics: dict[str, Any], weight: float, before: tuple | None,
                 loss_fn: Callable[..., Any], step: int) -> tuple:
        """A micro-step's metrics, weighted as its loss is and added to the step's so far (`before`; None at
        the first micro-step), in the order of `names`. At the first micro-step of the first step this
        process trains, the names are taken (the vote is refit to carry them: on a fresh job every member
        does so at the same step, and a member that loaded a state holds its names already); from then on
        they must stay the same, or the members' votes would differ in width."""
        names = tuple(sorted(metrics))
        if names != self.names:
            if before is not None or self._settled:
                with contract("loss", loss_fn, step):  # the workload's mistake: a WorkloadBug
                    raise ValueError(f"workload.loss returned the step metrics {list(names)} at step {step}, "
                                     f"and {list(self.names)} before: return the same names at every step")
            self.names = names
            self._resize_vote(len(names), True)
        self._settled = True
        weighted = tuple(metrics[name] * weight for name in names)
        return weighted if before is None else tuple(a + b for a, b in zip(before, weighted))

    def named(self, values: tuple) -> dict[str, float]:
        """A vote's metric values by name."""
        return {name: float(value) for name, value in zip(self.names, values)}
