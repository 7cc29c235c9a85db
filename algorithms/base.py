"""The Algorithm interface and the policy registry. Pure: no Ray, no backend imports.

An `Algorithm` holds settings (from `sync`, `compression`, `topology`); `bind()` turns it into
an `AlgorithmImpl` attached to one worker's model and optimizer. The worker's step loop calls
the implementation's hooks in a fixed order, the same for every policy:

    on_membership(comm)        once per membership epoch: buckets, peers, server handles
    begin_step(step, tail)     per step; `tail` is the step's metadata (loss, samples, vote)
    before_forward(step)       gossip policies launch their exchange here
    ... forward, backward (gradient hooks may launch communication), once per micro-step,
        with `accumulating` true on all but the last ...
    end_backward(step)         launch whatever is left (unused parameters, server pushes)
    finish_step(step) -> tail  wait for the step's communication; return the reduced tail
    after_optimizer_step(step) local-SGD averaging, gossip mixing, shadow hand-off
    state_dict / load_state_dict   algorithm state, sent to joiners with the model

Synchronous policies return the all-reduced tail, which carries the commit vote (see
actors/worker.py). A policy that does not communicate on a step returns the local tail.
"""
from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar, Optional

import torch

_REGISTRY: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    # Importing the modules registers their classes; kept lazy so schema imports stay cheap.
    from algorithms import allreduce  # noqa: F401


def known_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def policy_knobs(name: str) -> tuple[str, ...]:
    _load_builtin()
    return _REGISTRY[name].knobs


def get_algorithm(name: str) -> type["Algorithm"]:
    _load_builtin()
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


class AlgorithmImpl:
    """No-op hooks; each policy overrides the few it needs."""

    def __init__(self, algorithm: "Algorithm", model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.algorithm = algorithm
        self.model = model
        self.optimizer = optimizer
        self.comm: Any = None
        self.accumulating = False
        """Set by the worker during micro-steps before the last one of a step (gradient
        accumulation): gradients accumulate locally, and communication waits for the last."""

    @property
    def bytes_sent(self) -> int:
        return 0 if self.comm is None else self.comm.bytes_sent

    def on_membership(self, comm: Any) -> None:
        self.comm = comm

    def begin_step(self, step: int, tail: torch.Tensor) -> None:
        self._tail = tail

    def before_forward(self, step: int) -> None:
        pass

    def end_backward(self, step: int) -> None:
        pass

    def finish_step(self, step: int) -> torch.Tensor:
        return self._tail

    def after_optimizer_step(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Algorithm(ABC):
    """Settings of one policy; `bind()` makes the per-worker implementation."""

    name: ClassVar[str]
    kind: ClassVar[str]
    """synchronous / server / decentralized / shadow: decides what a step means."""
    knobs: ClassVar[tuple[str, ...]] = ()
    impl: ClassVar[type[AlgorithmImpl]] = AlgorithmImpl

    def __init__(self, bucket_mb: float = 25.0, **knobs: Optional[Any]) -> None:
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.settings = {k: v for k, v in knobs.items() if v is not None}

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> AlgorithmImpl:
        return self.impl(self, model, optimizer)
