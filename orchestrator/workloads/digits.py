"""scikit-learn's 8x8 digits (ships inside the package: no download): an MLP and a small CNN.

The held-out split is fixed (20 %, stratified, random_state 0) inside the workload, so every
worker and every run sees the same train/eval partition. Pixels are scaled to [0, 1].
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from orchestrator.workloads import Workload, with_modelled_compute


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "elastic-orchestrator" / "digits-split-v1.npz"


def _load_arrays() -> dict[str, np.ndarray]:
    """The fixed split, cached as a small .npz (saves every worker the ~1 s sklearn import)."""
    path = _cache_path()
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in ("x_tr", "y_tr", "x_te", "y_te")}
    except (OSError, KeyError, ValueError):
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    arrays = {"x_tr": x_tr.astype(np.uint8), "y_tr": y_tr.astype(np.int64),
              "x_te": x_te.astype(np.uint8), "y_te": y_te.astype(np.int64)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home just means no cache
    return arrays


@lru_cache(maxsize=1)
def _split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a = _load_arrays()
    as_x = lambda v: torch.tensor(v / 16.0, dtype=torch.float32)  # noqa: E731
    return as_x(a["x_tr"]), torch.from_numpy(a["y_tr"]), as_x(a["x_te"]), torch.from_numpy(a["y_te"])


def _inputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Inputs on the model's device and in its dtype (a bf16 model takes bf16 pixels)."""
    p = next(model.parameters())
    return x.to(device=p.device, dtype=p.dtype)


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(_inputs(model, x))
    return F.cross_entropy(logits, y.to(logits.device))


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> dict:
    x, y = data.tensors
    was_training = model.training
    model.eval()
    logits = model(_inputs(model, x)).float().cpu()
    model.train(was_training)
    return {"accuracy": (logits.argmax(1) == y).float().mean().item(), "eval_loss": F.cross_entropy(logits, y).item()}


def _workload(model: nn.Module, image: bool) -> Workload:
    x_tr, y_tr, x_te, y_te = _split()
    if image:
        x_tr, x_te = x_tr.view(-1, 1, 8, 8), x_te.view(-1, 1, 8, 8)
    return Workload(model=model, train_data=TensorDataset(x_tr, y_tr), eval_data=TensorDataset(x_te, y_te),
                    loss=cross_entropy, evaluate=accuracy)


def mlp(hidden: int = 128, depth: int = 2, dtype: str = "float32") -> Workload:
    """An MLP with `depth` hidden layers of `hidden` units, its parameters in `dtype`
    (float32, float64, bfloat16 or float16)."""
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return _workload(nn.Sequential(*layers).to(getattr(torch, dtype)), image=False)


def cnn(channels: int = 16) -> Workload:
    """Two 3x3 convolutions and a linear head over the 8x8 images."""
    model = nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * channels * 16, 10),
    )
    return _workload(model, image=True)


def bn_mlp(hidden: int = 64) -> Workload:
    """An MLP with a BatchNorm layer: its running statistics (buffers, not parameters) decide what the
    model predicts in eval mode, so a final model or checkpoint without them evaluates badly."""
    model = nn.Sequential(nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 10))
    return _workload(model, image=False)


def lab_mlp(hidden: int = 512, depth: int = 2, compute_ms: float = 0.0, slow: dict | None = None,
            jitter_sigma: float = 0.0, seed: int = 0) -> Workload:
    """The MLP with a modelled compute time, for the network lab's grid (orchestrator/lab_grid.py): see
    `orchestrator.workloads.with_modelled_compute`."""
    return with_modelled_compute(mlp(hidden=hidden, depth=depth), compute_ms, slow, jitter_sigma, seed)
