"""QAdam in process: during warm-up it is BSP with AdamW; after it, a frozen second moment and the
agreed first moment, against a plain-torch reference of that rule."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orchestrator.config import config_from_dict
from core.schema import ConfigError
from tests.unit.test_policy_oracles import run_replicas, SEED, global_batch_ids, max_diff, start_model

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "eps": 1e-3}
"""A larger eps than Adam's usual 1e-8: digits has pixels that are still zero in every batch of a short
warm-up, so their frozen second moment is 0 and a later gradient would be divided by eps alone."""
STEPS, N, GLOBAL_BATCH = 12, 3, 50


def run(tmp_path, sync: dict, compression: dict | None = None) -> list[torch.Tensor]:
    cfg = {"name": "qadam", "seed": SEED, "workers": {"count": N, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "optimizer": ADAMW, "sync": sync, "compression": compression or {}, "stop": {"max_steps": STEPS},
           "eval_every": 0}
    return run_replicas(tmp_path, cfg, N, GLOBAL_BATCH)


def reference_qadam(warmup: int) -> list[torch.Tensor]:
    """AdamW on the global batch for `warmup` steps, then Adam with the second moment frozen."""
    model, x, y = start_model()
    params = list(model.parameters())
    (beta1, beta2), eps, lr, decay = (0.9, 0.999), ADAMW["eps"], ADAMW["lr"], ADAMW["weight_decay"]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=decay, eps=eps, foreach=False)
    for step in range(STEPS):
        index = torch.tensor(global_batch_ids(step, GLOBAL_BATCH, len(x)))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        if step < warmup:
            opt.step()
            continue
        with torch.no_grad():
            for p in params:
                state = opt.state[p]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                p.mul_(1 - lr * decay)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** warmup)).sqrt() + eps
                p.sub_(lr * (state["exp_avg"] / (1 - beta1 ** (step + 1))) / denom)
    return [p.detach() for p in params]


def test_qadam_whose_warmup_covers_the_run_is_bsp_with_adamw(tmp_path):
    diff = max_diff(run(tmp_path / "q", {"policy": "qadam", "warmup_steps": STEPS}),
                    run(tmp_path / "b", {"policy": "bsp"}))
    print(f"qadam (warm-up {STEPS} of {STEPS} steps) vs bsp + AdamW: {diff:.2e}")
    assert diff <= 1e-6


def test_qadam_after_warmup_follows_the_frozen_variance_rule(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "qadam", "warmup_steps": 4}, {"codec": "none"}), reference_qadam(4))
    plain = max_diff(reference_qadam(4), reference_qadam(STEPS))
    print(f"qadam (warm-up 4, momentum in full precision) vs reference: {diff:.2e} (frozen vs live variance: {plain:.2e})")
    assert diff < 1e-6 and plain > 1e-4


def test_qadam_with_compressed_momentum_keeps_replicas_identical(tmp_path):
    """fp16 momentum stays within fp16 rounding of the rule; uint8 (256 levels per chunk, the momentum
    then divided by a small frozen sqrt(v)) drifts further, but every replica applies the same result."""
    fp16 = max_diff(run(tmp_path / "h", {"policy": "qadam", "warmup_steps": 4}, {"codec": "fp16"}), reference_qadam(4))
    uint8 = max_diff(run(tmp_path / "u", {"policy": "qadam", "warmup_steps": 4}, {"codec": "uint8"}), reference_qadam(4))
    print(f"qadam momentum vs the full-precision rule after 8 compressed steps: fp16 {fp16:.2e}, uint8 {uint8:.2e}")
    assert 0 < fp16 < 1e-3 and 0 < uint8 < 0.3


def test_qadam_needs_adamw():
    base = {"name": "x", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 5}}
    with pytest.raises(ConfigError, match="optimizer.name: qadam is Adam"):
        config_from_dict(dict(base, sync={"policy": "qadam"}))
