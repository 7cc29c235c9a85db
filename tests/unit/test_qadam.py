"""QAdam in process: during warm-up it is BSP with AdamW; after it, a frozen second moment and the
agreed first moment, against a plain-torch reference of that rule."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.schema import ConfigError
from orchestrator.config import config_from_dict
from testkit.harness import LocalJob
from tests.unit.test_policy_oracles import SEED, global_batch_ids, max_diff, run_replicas, share, start_model

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "eps": 1e-3, "no_decay": []}  # every weight decays, as the reference
"""A larger eps than Adam's usual 1e-8: digits has pixels that are still zero in every batch of a short
warm-up, so their frozen second moment is 0 and a later gradient would be divided by eps alone."""
STEPS, N, GLOBAL_BATCH = 12, 3, 50


def run(tmp_path, sync: dict, compression: dict | None = None) -> list[torch.Tensor]:
    cfg = {"name": "qadam", "seed": SEED, "workers": {"count": N, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "optimizer": ADAMW, "sync": sync, "compression": compression or {}, "stop": {"max_steps": STEPS},
           "eval_every": 0}
    return run_replicas(tmp_path, cfg, N, GLOBAL_BATCH)


def warmed_up(warmup: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.optim.AdamW]:
    """The oracles' model and data, and AdamW after `warmup` steps on the global batch (QAdam's warm-up
    is BSP with AdamW, exactly)."""
    model, x, y = start_model()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"], eps=ADAMW["eps"],
                            foreach=False)
    for step in range(warmup):
        index = torch.tensor(global_batch_ids(step, GLOBAL_BATCH, len(x)))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        opt.step()
    return model, x, y, opt


def reference_qadam(warmup: int) -> list[torch.Tensor]:
    """AdamW on the global batch for `warmup` steps, then Adam with the second moment frozen."""
    model, x, y, opt = warmed_up(warmup)
    params = list(model.parameters())
    (beta1, beta2), eps, lr, decay = (0.9, 0.999), ADAMW["eps"], ADAMW["lr"], ADAMW["weight_decay"]
    for step in range(warmup, STEPS):
        index = torch.tensor(global_batch_ids(step, GLOBAL_BATCH, len(x)))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
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
    assert 0 < fp16 < 1e-3 and 0 < uint8  # how far uint8 may drift is checked step by step below


def _state_after(tmp_path, steps: int) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """w0's parameters, agreed momentum (flat, all buckets) and the parameters' order in it, after
    `steps` steps of qadam with uint8."""
    cfg = {"name": "qadam", "seed": SEED, "workers": {"count": N, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "optimizer": ADAMW, "sync": {"policy": "qadam", "warmup_steps": 4}, "compression": {"codec": "uint8"},
           "stop": {"max_steps": steps}, "eval_every": 0}
    slots = [f"w{i}" for i in range(N)]
    job = LocalJob(cfg, slots, str(tmp_path))
    job.run(tuple(slots), GLOBAL_BATCH)
    impl = job.replicas["w0"].policy.impl
    order = [i for members in impl.plan.buckets for i in members]  # which parameter each stretch of m is
    m = torch.cat(impl.state_dict()["m"])
    return job.parameters("w0"), m, order


@pytest.mark.parametrize("step", [4, 7, 11])
def test_qadam_uint8_agrees_on_a_momentum_within_the_codecs_bound_and_applies_the_rule_to_it(tmp_path, step):
    """One compressed step (0-based `step`, after a warm-up of 4) from the run's own state:
    - the agreed momentum m_t is within the quantization bound of beta1 * m_{t-1} + (1 - beta1) * g,
      with g the global batch's mean gradient at x_{t-1}: each member sends s_i = beta1 / n * m_{t-1}
      + (1 - beta1) * g_i, quantized once (to 256 levels between its chunk's min and max: error at most
      range / 510), and the owner's sum once more; a chunk's range is at most the whole vector's;
    - x_t is the frozen-variance rule applied to that agreed m_t, exactly (AdamW's decay, bias
      corrections at t and at the warm-up's end)."""
    before, m_prev, order = _state_after(tmp_path / "a", step) if step > 4 else (None, None, None)
    after, m_new, order = _state_after(tmp_path / "b", step + 1)
    model, x, y, opt = warmed_up(4)
    params = list(model.parameters())
    (beta1, beta2), eps, lr, decay = (0.9, 0.999), ADAMW["eps"], ADAMW["lr"], ADAMW["weight_decay"]
    v = torch.cat([opt.state[params[i]]["exp_avg_sq"].reshape(-1) for i in order])
    if before is None:  # the first compressed step starts from the warm-up's own state
        before = [p.detach().clone() for p in params]
        m_prev = torch.cat([opt.state[params[i]]["exp_avg"].reshape(-1) for i in order])
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
    ids = global_batch_ids(step, GLOBAL_BATCH, len(x))
    sends, grads = [], []
    for rank in range(N):
        mine = torch.tensor(share(ids, rank, N))
        model.zero_grad()
        (F.cross_entropy(model(x[mine]), y[mine], reduction="sum") / GLOBAL_BATCH).backward()
        g = torch.cat([params[i].grad.reshape(-1) for i in order])
        grads.append(g)
        sends.append(beta1 / N * m_prev + (1 - beta1) * g)
    exact = beta1 * m_prev + (1 - beta1) * torch.stack(grads).sum(0)
    span = lambda t: float(t.max() - t.min())  # noqa: E731
    first = sum(span(s_) for s_ in sends) / 510  # the members' quantization, summed by the owner
    rounding = (N + 2) * 8 * torch.finfo(torch.float32).eps * float(exact.abs().max())
    bound = first + (span(exact) + 2 * first) / 510 + rounding  # and the owner's, of a sum off by `first`
    error = float((m_new - exact).abs().max())
    t = step + 1
    update = m_new / (1 - beta1 ** t) / ((v / (1 - beta2 ** 4)).sqrt() + eps)
    offset, rule = 0, [None] * len(params)
    for i in order:
        p = before[i]
        rule[i] = p * (1 - lr * decay) - lr * update[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    applied = max_diff(after, rule)
    print(f"step {step}: |m - exact| {error:.2e} within the bound {bound:.2e}; x vs the rule on m: {applied:.2e}")
    assert 0 < error <= bound
    assert applied < 1e-6


def test_qadam_needs_adamw():
    base = {"name": "x", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 5}}
    with pytest.raises(ConfigError, match="optimizer.name: qadam is Adam"):
        config_from_dict(dict(base, sync={"policy": "qadam"}))
