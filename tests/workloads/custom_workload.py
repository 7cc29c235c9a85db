"""A user workload that lives outside the package: a linear classifier on blobs made with a seed.

`fail_at_step` makes the loss raise on its N-th call (a real user-code exception); `fail_slot`
makes every loss call raise in that slot (read from ORCHESTRATOR_SLOT, which the worker sets);
`start_delay_s` makes the factory take that long (a slow import or data load); `start_gate`, a path:
the factory waits until that file exists (a slow start that ends when a test says so); `hold_at_call`
with `hold_gate`: the loss's call of that number waits until the gate file exists (a job held mid-run
until a test has seen it running). `metrics` makes the loss return step metrics beside the loss:
`mean_label` (the mean of the batch's labels; the label of training sample i is i % 4, so a test can
work out any batch's value from its ids) and `accuracy`, as `(loss, {...})` ("tuple"), as
`{"loss": loss, ...}` ("dict"), or as Python floats in a tuple ("float").
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class Blobs:
    def __init__(self, n: int, fail_at_step: int, fail_slot: str, hold_at_call: int = 0, hold_gate: str = "",
                 metrics: str = "") -> None:
        g = torch.Generator().manual_seed(1234)
        centers = torch.randn(4, 16, generator=g) * 3
        y = torch.arange(n) % 4
        x = centers[y] + torch.randn(n, 16, generator=g)
        self.model = torch.nn.Linear(16, 4)
        self.train_data = TensorDataset(x[: n - 200], y[: n - 200])
        self.eval_data = TensorDataset(x[n - 200:], y[n - 200:])
        self.fail_at_step = fail_at_step
        self.fail_here = fail_slot != "" and os.environ.get("ORCHESTRATOR_SLOT") == fail_slot
        self.calls = 0
        self.hold_at_call, self.hold_gate = hold_at_call, hold_gate
        self.metrics = metrics

    def loss(self, model, batch):
        self.calls += 1
        while self.calls == self.hold_at_call and not os.path.exists(self.hold_gate):
            time.sleep(0.05)
        if self.calls == self.fail_at_step:
            raise ValueError(f"user code failed on call {self.calls}")
        if self.fail_here:
            raise RuntimeError(f"user code always fails in slot {os.environ['ORCHESTRATOR_SLOT']}")
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if not self.metrics:
            return loss
        step = {"mean_label": y.float().mean(), "accuracy": (logits.argmax(1) == y).float().mean()}
        if self.metrics == "dict":
            return {"loss": loss, **step}
        if self.metrics == "float":
            return loss, {name: value.item() for name, value in step.items()}
        return loss, step

    def evaluate(self, model, data):
        x, y = data.tensors
        with torch.no_grad():
            return {"accuracy": (model(x).argmax(1) == y).float().mean().item()}


def make(n: int = 1200, fail_at_step: int = 0, fail_slot: str = "", start_delay_s: float = 0.0,
         start_gate: str = "", hold_at_call: int = 0, hold_gate: str = "", metrics: str = "") -> Blobs:
    time.sleep(start_delay_s)
    while start_gate and not os.path.exists(start_gate):
        time.sleep(0.05)
    return Blobs(n, fail_at_step, fail_slot, hold_at_call, hold_gate, metrics)
