"""BSP with compressed buckets (`compression.codec`, and `bytegrad`), in process against plain-torch
references: each rank's share-weighted gradient, the scatter-gather written out literally, one
optimizer step on the result."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from algorithms.compression import get_codec
from tests.unit.test_policy_oracles import run_replicas, SEED, global_batch_ids, make_opt, max_diff, reference_bsp, share, start_model
from tests.unit.test_scatter_gather import _reference

SGD_M = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.001}
STEPS, N, GLOBAL_BATCH = 12, 3, 50  # 50 samples over 3 ranks: shares of 17, 17 and 16


def run(tmp_path, sync: dict, compression: dict) -> list[torch.Tensor]:
    cfg = {"name": "compressed", "seed": SEED, "workers": {"count": N, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "optimizer": SGD_M, "sync": sync, "compression": compression, "stop": {"max_steps": STEPS}, "eval_every": 0}
    return run_replicas(tmp_path, cfg, N, GLOBAL_BATCH)


def reference_compressed(codec_name: str, feedback: bool) -> list[torch.Tensor]:
    """One bucket (the parameters in reverse order, as BSP's bucket plan lays them out), each rank's
    gradient of its share's mean loss times n_i / B, then the reference scatter-gather's SUM."""
    model, x, y = start_model()
    params = list(model.parameters())
    opt = make_opt(params, SGD_M)
    codec = get_codec(codec_name)
    steps = []
    for step in range(STEPS):
        ids = global_batch_ids(step, GLOBAL_BATCH, len(x))
        flats = []
        for rank in range(N):
            mine = torch.tensor(share(ids, rank, N))
            model.zero_grad()
            (F.cross_entropy(model(x[mine]), y[mine]) * (len(mine) / GLOBAL_BATCH)).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in reversed(params)]))
        steps.append(flats)
        summed = _reference(codec, steps, feedback)[-1]  # the residuals replay the earlier steps
        offset = 0
        for p in reversed(params):
            p.grad = summed[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    return [p.detach() for p in params]


def test_fp16_buckets_stay_within_fp16_rounding_of_uncompressed_bsp(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "bsp"}, {"codec": "fp16"}), reference_bsp(SGD_M, GLOBAL_BATCH))
    print(f"bsp + fp16 vs uncompressed single-process reference, {STEPS} steps: {diff:.2e}")
    assert diff < 1e-4


def test_bytegrad_equals_the_literal_scatter_gather_reference(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "bytegrad"}, {}), reference_compressed("uint8", feedback=False))
    print(f"bytegrad (uint8) vs reference: {diff:.2e}")
    assert diff < 1e-6


def test_onebit_with_error_feedback_equals_its_reference(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "bsp"}, {"codec": "onebit", "feedback": True}),
                    reference_compressed("onebit", feedback=True))
    print(f"bsp + onebit with error feedback vs reference: {diff:.2e}")
    assert diff < 1e-6
