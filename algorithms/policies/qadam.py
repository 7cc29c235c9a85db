"""QAdam (BAGUA's compressed Adam): full-precision Adam while warming up, then a frozen second
moment and a momentum that travels compressed.

Steps 0 .. `warmup_steps` - 1 are `bsp` with the configured AdamW, unchanged: gradients are
all-reduced in full precision from the gradient hooks, and the optimizer keeps its moments. From
step `warmup_steps` on, the second moment v is frozen at its value after warm-up (each member holds
the same one: the warm-up was synchronous), and the members agree on the first moment m instead of
the gradient. Each member sends, per bucket,

    beta1 / n * m + (1 - beta1) * g_i

where g_i is its gradient of its share-weighted loss (the shares sum to the global-batch mean), so
the SUM over members is exactly Adam's new momentum; it travels through the compressed
scatter-gather (`compression.codec`, uint8 when unset; `none` sends it in full precision), with the
step's vote in its tail. Then, decoupled weight decay as AdamW's, and

    x <- x - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^T)) + eps)

with t the step count and T = `warmup_steps`. Momentum is agreed after each step, so every replica
stays identical; the state a joiner or a checkpoint needs (m, v, t) travels in `state_dict`.
"""
from __future__ import annotations

import torch

from algorithms.policies.allreduce import AllReduce, AllReduceImpl
from algorithms.policies.base import Algorithm, EpochInfo, VoteDraft, register
from algorithms.policies.optim import weight_decay_of
from algorithms.policies.scatter_gather import ScatterGather
from core.comm_api import Communicator


class QAdamImpl(AllReduceImpl):
    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.warmup = self.config.warmup_steps
        self.momentum_wire = self._wires(*super()._gradient_codec())
        """The momentum's compressed scatter-gather per bucket (none: it travels in full precision)."""
        self.m: list[torch.Tensor] | None = None
        """Per bucket, the agreed first moment (after warm-up)."""
        self.v: list[torch.Tensor] | None = None
        """Per bucket, the second moment frozen at the end of warm-up."""
        self.t = 0
        self._sent: list[torch.Tensor] = []

    def _gradient_codec(self):
        return None, False  # the warm-up is plain BSP: gradients in full precision

    @property
    def deferred(self) -> bool:
        return self.m is not None

    def on_membership(self, comm: Communicator | None, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        for wire in self.momentum_wire:
            assert comm is not None  # the momentum's wire runs on the epoch's group
            wire.bind(comm)

    def _tailed_wires(self) -> list[ScatterGather]:
        return [*self.compressed, *self.momentum_wire]

    def begin_step(self, step: int, draft: VoteDraft) -> None:
        if self.m is None and step >= self.warmup:
            self._freeze()
        super().begin_step(step, draft)

    def _freeze(self) -> None:
        """Leave warm-up: take AdamW's moments (the same on every member) per bucket; v stays as it is."""
        state = self.optimizer.state
        def flat(key: str, members) -> torch.Tensor:
            return torch.cat([state[self.params[i]][key].reshape(-1).clone() if self.params[i] in state
                              else torch.zeros(self.params[i].numel(), device=self.params[i].device) for i in members])
        self.m = [flat("exp_avg", members) for members in self.plan.buckets]
        self.v = [flat("exp_avg_sq", members) for members in self.plan.buckets]
        self.t = self.warmup

    def end_backward(self, step: int) -> None:
        if self.m is None or self.comm is None:
            return super().end_backward(step)
        self._sent = self._momentum_shares(self.comm.world_size)
        self._reduce_deferred(self._sent, self.momentum_wire)  # in place: the sums are Adam's new m

    def _momentum_shares(self, n: int) -> list[torch.Tensor]:
        """Per bucket, beta1 / n * m + (1 - beta1) * g: summed over n members, Adam's new first moment."""
        beta1 = self.optimizer.param_groups[0]["betas"][0]
        m = self.m
        assert m is not None  # past warm-up only
        return [m[b] * (beta1 / n) + self.buffers[b][:m[b].numel()] * (1 - beta1) for b in range(len(m))]

    def apply_update(self, step: int, lr: float) -> None:
        if self.m is None:
            return super().apply_update(step, lr)
        assert self.v is not None  # set together with m
        group = self.optimizer.param_groups[0]
        (beta1, beta2), eps = group["betas"], group["eps"]
        decays = weight_decay_of(self.optimizer, self.params)  # each parameter's group's (no-decay groups)
        self.t += 1
        if self.comm is None:  # alone: no peers to agree with, the rule on the local gradient
            self._sent = self._momentum_shares(1)
        with torch.no_grad():
            for b, members in enumerate(self.plan.buckets):
                self.m[b] = self._sent[b].clone()
                denom = (self.v[b] / (1 - beta2 ** self.warmup)).sqrt_().add_(eps)
                update = self.m[b] / (1 - beta1 ** self.t) / denom
                offset = 0
                for i in members:
                    p = self.params[i]
                    p.mul_(1 - lr * decays[i])
                    p.add_(update[offset:offset + p.numel()].view_as(p), alpha=-lr)
                    offset += p.numel()

    def commit(self, step: int) -> None:
        super().commit(step)
        for wire in self.momentum_wire:
            wire.commit()

    def discard(self, step: int) -> None:
        super().discard(step)
        for wire in self.momentum_wire:
            wire.discard()

    def state_dict(self) -> dict:
        if self.m is None:
            return {}
        assert self.v is not None  # set together with m
        return {"m": [m.clone() for m in self.m], "v": [v.clone() for v in self.v], "t": self.t}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.m, self.v, self.t = list(state["m"]), list(state["v"]), int(state["t"])
        else:
            self.m = self.v = None


@register
class QAdam(AllReduce):
    """Full-precision Adam during `warmup_steps`, then frozen variance and compressed momentum."""

    name = "qadam"
    impl = QAdamImpl
