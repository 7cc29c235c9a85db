"""The server's copy of the model: the flat parameter vector cut into shards, each with its own optimizer.

Shards are contiguous ranges of the flat parameter vector (not parameter boundaries: a flat buffer
may be cut anywhere), each with its own optimizer. SGD and AdamW are elementwise, so any shard count
gives bit-identical results (tested). Cuts fall on multiples of `ALIGN` elements, so that every
element sits in the same vector lane as in one unsharded buffer; on the CPU build here unaligned cuts
were identical too, so this is insurance for kernels whose scalar tail rounds differently (FMA).

The final model's buffers (BatchNorm's running statistics) are not trained here: the server keeps each
member's newest and `combine_buffers` makes the final model's from them.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from algorithms.policies.optim import build_optimizer, set_lr
from core.schema import OptimizerConfig

ALIGN = 64
"""Shard cuts fall on multiples of this many elements (a multiple of every CPU vector width)."""


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """`shards` contiguous [start, end) ranges of `numel` elements, cut at multiples of ALIGN."""
    blocks = -(-numel // ALIGN)
    count = max(1, min(shards, blocks))
    cuts = [min(numel, round(k * blocks / count) * ALIGN) for k in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class ShardedParameters:
    """The parameters as flat float32 shards (`shard_bounds`), an optimizer per shard built from the
    job's optimizer config, and one buffer where an update's gradients are summed."""

    def __init__(self, parameters: Sequence[torch.Tensor], optimizer: OptimizerConfig, shards: int) -> None:
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in parameters])
        self.bounds = shard_bounds(flat.numel(), shards)
        self.shards = [flat[a:b].clone().requires_grad_() for a, b in self.bounds]
        self.numel = flat.numel()
        self._total = torch.empty(self.numel)
        """Where an update's pushes are summed and scaled."""
        self.optimizers = [build_optimizer([shard], optimizer) for shard in self.shards]
        self.clip = optimizer.clip_grad_norm
        """`optimizer.clip_grad_norm`: the update's whole gradient is clipped to it, across the shards."""
        self.grad_norm: float | None = None
        """The newest update's gradient norm before clipping (with clipping)."""

    def parameters(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat parameter vector (a copy; into `out` when given)."""
        return torch.cat([shard.detach() for shard in self.shards], out=out)

    def step(self, grads: Sequence[torch.Tensor], scale: float, lr: float) -> None:
        """One optimizer step per shard on `scale` times the sum of `grads`, added in the given order."""
        total = self._total  # one buffer, reused: no allocation per update
        if len(grads) == 1:
            torch.mul(grads[0], scale, out=total)  # the same rounding as copy then scale, one pass
        else:
            total.copy_(grads[0])
            for grad in grads[1:]:
                total += grad
            total *= scale
        if self.clip is not None:  # the gradient this update applies, as clip_grad_norm_ clips one tensor
            norm = float(torch.linalg.vector_norm(total))
            self.grad_norm = norm
            if norm + 1e-6 > self.clip:
                total *= self.clip / (norm + 1e-6)
        for shard, opt, (a, b) in zip(self.shards, self.optimizers, self.bounds):
            shard.grad = total[a:b]
            set_lr(opt, lr)
            opt.step()
            shard.grad = None

    def state_dict(self) -> dict:
        """The bounds, copies of the shards and of the optimizers' states (an optimizer's own
        `state_dict()` holds the live tensors its next step writes into)."""
        return {"bounds": [list(b) for b in self.bounds], "shards": [s.detach().clone() for s in self.shards],
                "optimizers": [copy.deepcopy(opt.state_dict()) for opt in self.optimizers]}

    def fits(self, state: dict) -> bool:
        """Whether a snapshot's shards were cut as these are."""
        return [tuple(b) for b in state["bounds"]] == self.bounds

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for shard, saved in zip(self.shards, state["shards"]):
                shard.copy_(saved)
        for opt, saved in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(saved)


def combine_buffers(flats: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """The model buffers a server kind's final model takes from its members' newest (`flats`, each the
    model's buffers flattened as float64, lowest rank first): floating-point buffers averaged over
    the members, the others (BatchNorm's batch count) the lowest-ranked member's, as the average of
    replicas does for the kinds whose replicas differ. `buffers` gives the shapes and dtypes. None
    when no member sent any."""
    if not flats or not buffers:
        return None
    mean = torch.stack(list(flats)).mean(0)
    out, at = [], 0
    for b in buffers:
        n = b.numel()
        source = mean if torch.is_floating_point(b) else flats[0]
        out.append(source[at:at + n].reshape(b.shape).to(b.dtype))
        at += n
    return out
