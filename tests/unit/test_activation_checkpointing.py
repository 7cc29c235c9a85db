"""`training.activation_checkpointing`: each block's activations recomputed in the backward (its forward
runs again in the backward), the training unchanged (BSP with it equals BSP without it), a Hugging Face model
switched to its own checkpointing, a model without a switch refused in one line."""
from __future__ import annotations

import pytest
import torch

from actors.training.workload import build_workload
from core.schema import WorkloadRefused
from orchestrator.config import config_from_dict
from orchestrator.workloads import lm
from testkit.harness import LocalJob

GPT = {"size": "tiny", "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16}


def config(checkpointing: bool, factory: str = "orchestrator.workloads.lm:gpt", params: dict | None = None) -> dict:
    return {"name": "ckpt", "seed": 3, "workers": {"count": 2, "cpus": 1},
            "workload": {"factory": factory, "params": GPT if params is None else params, "batch_size": 4},
            "optimizer": {"name": "adamw", "lr": 3e-3}, "training": {"activation_checkpointing": checkpointing},
            "sync": {"policy": "bsp", "bucket_mb": 0.01}, "stop": {"max_steps": 6}, "eval_every": 0}


def run(tmp_path, checkpointing: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    calls = [0]
    forward = lm.Block.forward

    def counted(self, x):
        calls[0] += 1
        return forward(self, x)
    monkeypatch.setattr(lm.Block, "forward", counted)
    job = LocalJob(config(checkpointing), ["w0", "w1"], str(tmp_path / str(checkpointing)))
    job.run(("w0", "w1"), 8)
    monkeypatch.setattr(lm.Block, "forward", forward)
    return job.parameters("w0"), calls[0]


def test_checkpointed_blocks_run_their_forward_again_in_the_backward_and_train_the_same(tmp_path, monkeypatch):
    plain, plain_calls = run(tmp_path, False, monkeypatch)
    ours, ours_calls = run(tmp_path, True, monkeypatch)
    print(f"block forwards: {plain_calls} without checkpointing, {ours_calls} with")
    assert ours_calls - plain_calls == 2 * 6 * 2  # each block of each step of each worker, again in the backward
    assert max(float((p - q).abs().max()) for p, q in zip(ours, plain)) < 1e-6


def test_a_hugging_face_model_takes_its_own_checkpointing():
    pytest.importorskip("transformers")
    params = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16}
    workload = build_workload(config_from_dict(config(True, "orchestrator.workloads.hf:causal_lm", params)))
    model = workload.model
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing  # its name since v5


def test_a_model_without_a_switch_is_refused_in_one_line():
    cfg = config_from_dict(config(True, "orchestrator.workloads.digits:mlp", {"hidden": 8}))
    with pytest.raises(WorkloadRefused, match="has no gradient_checkpointing_enable"):
        build_workload(cfg)
