"""Built-in workloads and the contract every workload meets.

A workload factory is called as `factory(**workload.params)` and returns an object with
`model`, `train_data` (a map-style torch dataset), optionally `eval_data`,
`loss(model, batch) -> Tensor` and optionally `evaluate(model, eval_data) -> dict` and
`tokens_per_sample` (a sequence model's tokens in one sample: progress, status, history and the
metrics then show tokens per second).
The contract itself, with `Workload` (a convenient container for it; any object with those attributes
works), is core/workload_api.py; both are importable from here too.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from core.workload_api import MapData, MeanEvaluation, Workload, WorkloadLike

__all__ = ["MapData", "MeanEvaluation", "Workload", "WorkloadLike", "with_modelled_compute"]


def with_modelled_compute(workload: Any, compute_ms: float = 0.0, slow: dict | None = None, jitter_sigma: float = 0.0,
                          seed: int = 0) -> Any:
    """`workload` with a modelled compute time, for the network lab: each loss call (one per step without
    micro-batches) sleeps `compute_ms`, times `slow[slot]` for the slots named there (a 3x straggler:
    `{w1: 3}`), times a lognormal factor exp(sigma z) drawn from (seed, slot, call) when `jitter_sigma`
    is set. The sleep sits in the forward pass, where a GPU would compute: traffic a policy launches
    before the step (gossip) overlaps it, traffic launched from backward (BSP's buckets) does not. A
    sleep frees the CPU, as a GPU's compute would."""
    import time

    import numpy as np

    inner = workload.loss
    slot = os.environ.get("ORCHESTRATOR_SLOT", "w0")
    factor = float((slow or {}).get(slot, 1.0))
    index = int(slot[1:]) if slot[1:].isdigit() else 0
    calls = [0]

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        seconds = compute_ms / 1e3 * factor
        if jitter_sigma > 0:
            z = np.random.default_rng([seed, index, calls[0]]).standard_normal()
            seconds *= float(np.exp(jitter_sigma * z))
        calls[0] += 1
        if seconds > 0:
            time.sleep(seconds)
        return inner(model, batch)

    workload.loss = loss
    return workload
