"""Mixed precision and gradient clipping (algorithms/policies/precision.py) through real replicas in
threads: BSP under `bf16-mixed` against one process running the same autocast loop on the global
batches; clipping against its definition on the global batch's gradient in float64; fp16's loss scale
against torch's GradScaler loop; the parameter server's clipping; and why `bf16-mixed` exists (pure
bf16 AdamW loses LayerNorm's updates)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from algorithms.policies.precision import GuardedOptimizer, LossScale
from algorithms.policies.server_shards import ShardedParameters
from core.schema import OptimizerConfig
from orchestrator.workloads import digits, lm
from testkit.harness import LocalJob
from tests.unit.test_policy_oracles import global_batch_ids, share

SEED, STEPS, GLOBAL = 3, 12, 12
GPT = {"size": "tiny", "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16}
ADAMW = {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}


def lm_config(world: int, precision: str, **optimizer) -> dict:
    return {"name": "precision", "seed": SEED, "workers": {"count": world, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.lm:gpt", "params": GPT, "batch_size": GLOBAL // world},
            "optimizer": {**ADAMW, **optimizer}, "training": {"precision": precision},
            "sync": {"policy": "bsp", "bucket_mb": 0.01}, "stop": {"max_steps": STEPS}, "eval_every": 0}


def run_bsp(tmp_path, config: dict, world: int) -> tuple[list[torch.Tensor], LocalJob]:
    slots = [f"w{i}" for i in range(world)]
    job = LocalJob(config, slots, str(tmp_path))
    job.run(tuple(slots), GLOBAL)
    return job.agreed_parameters(slots), job


def autocast_reference(dtype: torch.dtype | None, world: int = 1) -> list[torch.Tensor]:
    """One process: each global batch's mean next-token cross-entropy, its forward under autocast to
    `dtype` (None: float32 throughout), float32 weights, gradients and AdamW state: the definition of
    mixed-precision training. The global batch runs as `world` micro-batches (the members' shares, in
    rank order), each weighted by its share of the batch, their gradients accumulated in float32."""
    torch.manual_seed(SEED)
    workload = lm.gpt(**GPT)
    model, (rows,) = workload.model, workload.train_data.tensors
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), weight_decay=0.0)
    for step in range(STEPS):
        ids = global_batch_ids(step, GLOBAL, len(rows))
        opt.zero_grad()
        for rank in range(world):
            batch = rows[torch.tensor(share(ids, rank, world))].long()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
            (loss * len(batch) / GLOBAL).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((p.float() - q.float()).abs().max()) for p, q in zip(a, b))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bsp_under_bf16_mixed_equals_one_process_running_the_autocast_loop(tmp_path, world):
    """The reference runs each global batch as the members' shares, accumulated: under autocast a matmul's
    output is rounded to bf16 once per batch it computes, so the whole batch at once differs from any
    split of it by bf16's rounding of the weight gradients (2^-9 of each), which AdamW then amplifies
    (measured here after 12 steps: 1.7e-2, as far as bf16 is from float32 itself). With the split
    written out, what is left is float32's: the order the shares' gradients are summed in (the same
    bound as the float32 oracle in test_lm.py). Without autocast BSP would be the float32 loop, 1e-2 away."""
    ours, _ = run_bsp(tmp_path, lm_config(world, "bf16-mixed"), world)
    mixed, fp32 = autocast_reference(torch.bfloat16, world), autocast_reference(None, world)
    diff, scale = largest(ours, mixed), largest(mixed, fp32)
    print(f"bf16-mixed BSP at {world}: {diff:.2e} from the autocast loop on the global batch; the autocast and float32 "
          f"loops differ by {scale:.2e}")
    assert scale > 1e-3, "bf16 autocast changed nothing: the reference is not mixed"
    assert diff < 1e-5
    assert all(p.dtype == torch.float32 for p in ours)  # the master weights stay float32


def digits_config(world: int, clip: float | None, policy: str = "bsp") -> dict:
    optimizer = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
    if clip is not None:
        optimizer["clip_grad_norm"] = clip
    return {"name": "clip", "seed": SEED, "workers": {"count": world, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16, "dtype": "float64"},
                         "batch_size": GLOBAL // world},
            "optimizer": optimizer, "sync": {"policy": policy}, "stop": {"max_steps": STEPS}, "eval_every": 0}


def clipped_reference(clip: float) -> tuple[list[torch.Tensor], list[float]]:
    """One process in float64: the global batch's mean cross-entropy, its gradient g scaled by
    min(1, clip / (||g||_2 + 1e-6)) (the norm over every parameter together), then SGD with momentum."""
    torch.manual_seed(SEED)
    workload = digits.mlp(hidden=16, dtype="float64")
    model, data = workload.model, workload.train_data
    params = list(model.parameters())
    momentum = [torch.zeros_like(p) for p in params]
    norms = []
    for step in range(STEPS):
        ids = global_batch_ids(step, GLOBAL, len(data))
        x = torch.stack([data[i][0] for i in ids]).to(torch.float64)
        y = torch.stack([torch.as_tensor(data[i][1]) for i in ids])
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        norm = sum(float((g * g).sum()) for g in grads) ** 0.5
        norms.append(norm)
        coef = min(1.0, clip / (norm + 1e-6))
        with torch.no_grad():
            for p, g, m in zip(params, grads, momentum):
                m.mul_(0.9).add_(g * coef) if step else m.copy_(g * coef)
                p.sub_(0.5 * m)
    return [p.detach() for p in params], norms


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_under_bsp_is_clip_grad_norm_of_the_global_batch(tmp_path, world):
    ours, job = run_bsp(tmp_path, digits_config(world, clip=0.05), world)
    reference, norms = clipped_reference(0.05)
    diff = largest(ours, reference)
    recorded = [r["grad_norm"] for r in job.replicas["w0"].reporter.kept]
    print(f"clipped BSP at {world} (float64): {diff:.2e} from the definition; norms {min(norms):.3f}-{max(norms):.3f}")
    assert min(norms) > 0.05  # every step clipped: the mechanism is exercised at each one
    assert diff <= 1e-6
    assert recorded == pytest.approx(norms, rel=1e-9)  # history holds the norm before clipping


def test_without_clipping_the_same_run_is_far_from_the_clipped_definition(tmp_path):
    """The oracle above can fail: with the mechanism off, the run is nowhere near the clipped reference."""
    ours, job = run_bsp(tmp_path, digits_config(2, clip=None), 2)
    assert largest(ours, clipped_reference(0.05)[0]) > 1e-3
    assert all("grad_norm" not in r for r in job.replicas["w0"].reporter.kept)


def test_the_guard_clips_a_local_gradient_as_clip_grad_norm_does():
    """Periodic, decentralized and background kinds step on each member's own gradient: the guard
    clips that one as torch's clip_grad_norm_ would."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    grads = [torch.randn_like(p) * 4 for p in params]
    theirs = [p.detach().clone().requires_grad_() for p in params]
    for p, q, g in zip(params, theirs, grads):
        p.grad, q.grad = g.clone(), g.clone()
    guard = GuardedOptimizer(torch.optim.SGD(params, lr=1.0), clip=0.7)
    guard.step()
    torch.nn.utils.clip_grad_norm_(theirs, 0.7)
    torch.optim.SGD(theirs, lr=1.0).step()
    assert all(torch.allclose(p, q, atol=1e-12, rtol=0) for p, q in zip(params, theirs))
    assert float(guard.grad_norm) == pytest.approx(float(torch.cat([g.reshape(-1) for g in grads]).norm()), rel=1e-6)


def test_the_parameter_server_clips_the_gradient_it_applies():
    torch.manual_seed(0)
    weights = [torch.randn(300, dtype=torch.float32), torch.randn(77, dtype=torch.float32)]
    config = OptimizerConfig(name="sgd", lr=0.1, clip_grad_norm=0.5)
    server = ShardedParameters(weights, config, shards=3)
    pushes = [torch.randn(377), torch.randn(377)]
    server.step(pushes, 0.5, 0.1)
    total = (pushes[0] + pushes[1]) * 0.5
    expected = torch.cat(weights) - 0.1 * total * min(1.0, 0.5 / (float(total.norm()) + 1e-6))
    assert torch.allclose(server.parameters(), expected, atol=1e-6)
    assert server.grad_norm == pytest.approx(float(total.norm()), rel=1e-5)


def test_fp16_mixed_bsp_skips_the_steps_whose_gradient_overflows_as_torchs_grad_scaler_does(tmp_path):
    """One training sample overflows float16 (tests/workloads/overflow_workload.py); the step that holds it
    has a gradient that is not finite on the member that read it, hence in the reduced gradient every
    member holds: every member skips it and halves its scale, as torch's GradScaler does in one process
    on the global batch. The other steps train the same in both (to fp16's rounding of each share's
    activations: the bound)."""
    world, poisoned_step = 2, 4
    poison = global_batch_ids(poisoned_step, GLOBAL, 1437)[0]
    config = digits_config(world, clip=None)
    config["workload"] = {"factory": "tests.workloads.overflow_workload:make", "params": {"poison": poison},
                          "batch_size": GLOBAL // world}
    config["training"] = {"precision": "fp16-mixed"}
    ours, job = run_bsp(tmp_path, config, world)
    kept = job.replicas["w0"].reporter.kept

    from tests.workloads.overflow_workload import make
    torch.manual_seed(SEED)
    workload = make(poison=poison)
    model, data = workload.model, workload.train_data
    assert len(data) == 1437
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    reference_skipped = []
    for step in range(STEPS):
        ids = global_batch_ids(step, GLOBAL, len(data))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = workload.loss(model, (data.tensors[0][ids], data.tensors[1][ids]))
        opt.zero_grad()
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            reference_skipped.append(step + 1)
    guard = job.replicas["w0"].training.optimizer
    first_skip = next(r["step"] for r in kept if r.get("skipped_updates"))
    print(f"fp16-mixed: {guard.skipped} skipped (first at step {first_skip}); GradScaler skipped steps "
          f"{reference_skipped}; scale {guard.loss_scale.scale:g} vs {scaler.get_scale():g}")
    assert reference_skipped == [poisoned_step + 1]
    assert guard.skipped == 1 and first_skip == poisoned_step + 1
    assert guard.loss_scale.scale == scaler.get_scale() == 2.0 ** 15
    assert largest(ours, [p.detach() for p in model.parameters()]) < 1e-2


def test_the_loss_scale_halves_on_an_overflow_and_doubles_after_a_run_of_finite_steps():
    scale = LossScale(scale=8.0, interval=3)
    scale.update(False)
    assert scale.scale == 4.0
    for _ in range(3):
        scale.update(True)
    assert scale.scale == 8.0 and scale.finite_run == 0


def layer_norm_gains(tmp_path, precision: str) -> torch.Tensor:
    config = lm_config(1, precision, lr=3e-4)
    config["stop"]["max_steps"] = 30
    job = LocalJob(config, ["w0"], str(tmp_path / precision))
    job.run(("w0",), GLOBAL)
    model = job.replicas["w0"].training.model
    return torch.cat([m.weight.detach().float() for m in model.modules() if isinstance(m, torch.nn.LayerNorm)])


def test_bf16_mixed_adamw_moves_layer_norm_gains_where_pure_bf16_does_not(tmp_path):
    """A gain of 1.0 takes AdamW steps of about lr = 3e-4; bfloat16's spacing just below 1.0 is 2^-8
    (0.0039), so pure bf16 rounds every such step away, while the mixed mode's float32 master weights
    keep them."""
    mixed = layer_norm_gains(tmp_path, "bf16-mixed")
    pure = layer_norm_gains(tmp_path, "bf16")
    print(f"LayerNorm gains after 30 steps: bf16-mixed moved up to {float((mixed - 1).abs().max()):.4f}, "
          f"pure bf16 {float((pure - 1).abs().max()):.4f}")
    assert float((mixed - 1).abs().max()) > 3e-3
    assert float((pure - 1).abs().max()) == 0.0
