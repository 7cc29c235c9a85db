"""A user workload with the mistakes a user makes in their own code, one factory each (all otherwise a
small MLP on blobs made with a seed):

- `make(hidden)`: no mistake; `evaluate` returns accuracy and eval_loss (a config's typo in `params`,
  or a stop target naming another metric, is the config's mistake);
- `raising_factory`: the factory raises (its data file is missing);
- `failing_forward`: the model's forward fails on every batch (a layer of the wrong width);
- `vector_loss`: the loss is one value per sample, not a scalar;
- `string_metric`: `evaluate` returns a metric that is a string.

Each line where a mistake is made carries a `# mistake: <name>` comment, so that a test can tell which
file and line the job's error must name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 8, 4


class Blobs:
    """Four classes of blobs; the model an MLP of `hidden` units."""

    def __init__(self, hidden: int, n: int = 640) -> None:
        g = torch.Generator().manual_seed(7)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 3
        y = torch.arange(n) % CLASSES
        x = centers[y] + torch.randn(n, FEATURES, generator=g)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))
        self.train_data = TensorDataset(x[: n - 128], y[: n - 128])
        self.eval_data = TensorDataset(x[n - 128:], y[n - 128:])

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model, data):
        x, y = data.tensors
        with torch.no_grad():
            out = model(x)
        return {"accuracy": (out.argmax(1) == y).float().mean().item(), "eval_loss": F.cross_entropy(out, y).item()}


def make(hidden: int = 16) -> Blobs:
    return Blobs(hidden)


def _load(path: str) -> torch.Tensor:
    return torch.load(path, weights_only=True)  # mistake: factory


def raising_factory(hidden: int = 16) -> Blobs:
    blobs = Blobs(hidden)
    blobs.train_data = _load("/nonexistent/fmnist/train.pt")
    return blobs


class WrongWidth(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.first = torch.nn.Linear(FEATURES, hidden)
        self.second = torch.nn.Linear(hidden * 2, CLASSES)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))  # mistake: forward


def failing_forward(hidden: int = 16) -> Blobs:
    blobs = Blobs(hidden)
    blobs.model = WrongWidth(hidden)
    return blobs


class PerSampleLoss(Blobs):
    def loss(self, model, batch):  # mistake: vector_loss
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")


def vector_loss(hidden: int = 16) -> Blobs:
    return PerSampleLoss(hidden)


class StringMetric(Blobs):
    def evaluate(self, model, data):  # mistake: string_metric
        return {"quality": "high"}


def string_metric(hidden: int = 16) -> Blobs:
    return StringMetric(hidden)
