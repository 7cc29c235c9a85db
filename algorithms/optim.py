"""Optimizers and learning-rate schedules from `OptimizerConfig`. Pure torch, no Ray.

The schedule is a function of the committed step only, so a joiner or a resumed run that
knows the step knows the learning rate: linear warm-up over `warmup_steps`, then constant or
cosine decay to `min_lr` at `total_steps`. `lr_scale` multiplies the base LR (linear scaling
on reshape, when the config asks for it).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from core.schema import OptimizerConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               nesterov=cfg.nesterov, foreach=False)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             foreach=False)


def lr_at(step: int, cfg: OptimizerConfig, total_steps: Optional[int], lr_scale: float = 1.0) -> float:
    """Learning rate used for the update that produces committed step `step + 1`."""
    base = cfg.lr * lr_scale
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine" and total_steps:
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return cfg.min_lr + (base - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return base


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
