"""What happens to a step's numbers between the loss and the update: the precision the forward runs in
(`training.precision`), fp16's dynamic loss scale, and the gradient's norm and clipping
(`optimizer.clip_grad_norm`). Pure torch, no Ray.

`Precision` says how a step computes: under autocast (`bf16-mixed`, `fp16-mixed`: the weights, their
gradients and the optimizer's state stay float32, the master copy), in the model's own dtype (`fp32`,
and `bf16`, where the model itself was cast to bfloat16 when it was built).

`GuardedOptimizer` is the optimizer every policy steps: it holds the configured one and, before its
step, divides the gradients by the loss scale (fp16), skips the step when one of them is not finite
(counted; the scale backs off), and clips them to `clip_grad_norm`. Where the policy steps decides what
gradient that is: the reduced one for the kinds that reduce every step (every member holds the same, so
every member skips, scales and clips alike: nothing to agree on), each local step's own for the
periodic, decentralized and background kinds. The server kinds apply their update on the parameter
server (algorithms/policies/server_shards.py clips there).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
"""The mixed modes and the dtype their forward runs in."""
MODEL_DTYPE = {"bf16": torch.bfloat16}
"""The modes that cast the model itself when it is built, and to what."""


@dataclass(frozen=True)
class Precision:
    """A job's `training.precision` on one device."""

    mode: str
    device_type: str

    @property
    def scales_loss(self) -> bool:
        """fp16's range needs the loss scaled up before the backward (gradients would underflow)."""
        return self.mode == "fp16-mixed"

    def compute_dtype(self, parameters: torch.dtype) -> torch.dtype:
        """The dtype the step's matrix multiplies run in: the autocast dtype, else the parameters' own."""
        return AUTOCAST.get(self.mode, parameters)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Where the forward and the loss run: autocast in the mixed modes."""
        dtype = AUTOCAST.get(self.mode)
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=dtype):
            yield


class LossScale:
    """fp16's dynamic loss scale, as `torch.amp.GradScaler` keeps it: the loss is multiplied by `scale`
    before the backward; a step whose gradient is not finite is skipped and the scale halves; after
    `interval` finite steps in a row it doubles."""

    def __init__(self, scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5, interval: int = 2000) -> None:
        self.scale = scale
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.finite_run = 0
        """Finite steps since the scale last changed."""

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff
            self.finite_run = 0
            return
        self.finite_run += 1
        if self.finite_run == self.interval:
            self.scale *= self.growth
            self.finite_run = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "finite_run": self.finite_run}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.finite_run = float(state["scale"]), int(state["finite_run"])


class GuardedOptimizer:
    """The configured optimizer (`inner`), stepped only on a finite gradient, unscaled and clipped
    first (see the module's text). Its state and groups are the inner optimizer's own: a checkpoint or
    a joiner's state holds what it would hold without the guard, and the loss scale beside it."""

    def __init__(self, inner: Any, clip: float | None = None, loss_scale: LossScale | None = None) -> None:
        self.inner = inner
        self.clip = clip
        self.loss_scale = loss_scale
        self.grad_norm: torch.Tensor | None = None
        """The newest step's gradient norm before clipping (a 0-d tensor, read when recorded), where it
        was measured (with clipping or a loss scale)."""
        self.skipped = 0
        """Steps skipped because their gradient was not finite (fp16-mixed)."""

    # ------------------------------------------------------------------ the optimizer's surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.inner!r}, clip={self.clip}, loss_scale={self.loss_scale is not None})"

    # ------------------------------------------------------------------ the step
    @property
    def loss_multiplier(self) -> float:
        """What the step multiplies its loss by before the backward (the loss scale; 1 without one)."""
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.inner.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self) -> None:
        if self.clip is None and self.loss_scale is None:
            self.inner.step()
            return
        grads = self._grads()
        if self.loss_scale is not None and grads:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale.scale)
        norm = gradient_norm(grads)
        self.grad_norm = norm
        if self.loss_scale is not None:
            finite = math.isfinite(float(norm))  # the one read of the device a skipped step needs
            self.loss_scale.update(finite)
            if not finite:
                self.skipped += 1
                return
        if self.clip is not None and grads:
            factor = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, factor.to(grads[0].dtype))
        self.inner.step()

    def precision_state(self) -> dict[str, Any]:
        """What a joiner and a checkpoint carry beside the optimizer's state (the loss scale and the
        skipped steps), so that every member scales its loss alike."""
        return {"loss_scale": None if self.loss_scale is None else self.loss_scale.state_dict(), "skipped": self.skipped}

    def load_precision_state(self, state: dict[str, Any]) -> None:
        if self.loss_scale is not None and state.get("loss_scale") is not None:
            self.loss_scale.load_state_dict(state["loss_scale"])
        self.skipped = int(state.get("skipped", 0))


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of `grads` together (as `torch.nn.utils.clip_grad_norm_` measures it: each
    tensor's norm, then the norm of those), as a 0-d tensor on their device, in float64 where a gradient
    is, else float32 (a half-precision model's norm too); 0 for none."""
    if not grads:
        return torch.zeros(())
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), 2.0)


def guarded(optimizer: Any, clip: float | None, precision: Precision) -> GuardedOptimizer:
    """The optimizer a replica's policies step, for a job's clipping and precision."""
    return GuardedOptimizer(optimizer, clip, LossScale() if precision.scales_loss else None)
