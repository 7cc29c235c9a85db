"""The optimizer a transformer wants (algorithms/policies/optim.py): weight-decay groups that exempt
biases, normalization layers and embeddings (overridable), BSP with them equal to one process's AdamW
with the groups written out by hand, and the learning-rate rule on a resize that fits the optimizer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from algorithms.policies.optim import build_optimizer, parameter_groups
from algorithms.rules.membership import batch_for
from core.schema import OptimizerConfig, TorchOptimizerConfig
from orchestrator.workloads import lm
from testkit.harness import LocalJob
from tests.unit.test_policy_oracles import global_batch_ids

SEED, STEPS = 3, 10
GPT = {"size": "tiny", "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16}
DECAYED = {f"blocks.{i}.{name}.weight" for i in range(2) for name in ("qkv", "proj", "fc", "out")}
"""The GPT's matrices: what AdamW decays by default; everything else (biases, LayerNorms, the token
embedding tied to the output layer, the position table) is exempt."""


def names(model: torch.nn.Module, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_adamw_exempts_biases_norms_and_embeddings_and_sgd_decays_every_weight():
    torch.manual_seed(0)
    model = lm.gpt(**GPT).model
    groups = parameter_groups(model, OptimizerConfig(name="adamw", weight_decay=0.1))
    assert names(model, groups[0]) == DECAYED and "weight_decay" not in groups[0]
    exempt = names(model, groups[1])
    assert groups[1]["weight_decay"] == 0.0 and {"tok.weight", "pos", "ln_f.weight", "blocks.0.qkv.bias"} <= exempt
    assert exempt | DECAYED == {n for n, _ in model.named_parameters()} and not exempt & DECAYED
    assert len(parameter_groups(model, OptimizerConfig(name="sgd", weight_decay=0.1))) == 1
    assert len(parameter_groups(model, OptimizerConfig(name="adamw", weight_decay=0.0))) == 1
    assert len(parameter_groups(model, OptimizerConfig(name="adamw", weight_decay=0.1, no_decay=[]))) == 1
    biases = parameter_groups(model, OptimizerConfig(name="adamw", weight_decay=0.1, no_decay=["*.bias"]))
    assert names(model, biases[1]) == {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    torch_adam = parameter_groups(model, TorchOptimizerConfig(name="NAdam", args={"weight_decay": 0.1}))
    assert names(model, torch_adam[0]) == DECAYED  # the Adam family by name, through torch.optim too


def test_bsp_with_the_groups_equals_one_process_adamw_with_the_groups_written_out(tmp_path):
    config = {"name": "groups", "seed": SEED, "workers": {"count": 2, "cpus": 1},
              "workload": {"factory": "orchestrator.workloads.lm:gpt", "params": GPT, "batch_size": 4},
              "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.5}, "sync": {"policy": "bsp", "bucket_mb": 0.01},
              "stop": {"max_steps": STEPS}, "eval_every": 0}
    job = LocalJob(config, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 8)

    torch.manual_seed(SEED)
    workload = lm.gpt(**GPT)
    model, (rows,) = workload.model, workload.train_data.tensors
    by_name = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [by_name[n] for n in sorted(DECAYED)]},
                             {"params": [p for n, p in by_name.items() if n not in DECAYED], "weight_decay": 0.0}],
                            lr=3e-3, weight_decay=0.5)
    for step in range(STEPS):
        batch = rows[torch.tensor(global_batch_ids(step, 8, len(rows)))].long()
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    diff = max(float((p - q).abs().max()) for p, q in zip(job.parameters("w0"), model.parameters()))
    print(f"BSP with AdamW's groups vs one process: {diff:.2e}")
    assert diff < 1e-5
    assert float(job.replicas["w0"].training.model.ln_f.weight.sub(1).abs().max()) > 0  # trained, not decayed away


def test_the_fused_kernel_is_taken_where_asked():
    model = torch.nn.Linear(4, 2)
    assert build_optimizer(model, OptimizerConfig(name="adamw", implementation="fused")).defaults["fused"]
    assert not build_optimizer(model, OptimizerConfig(name="adamw")).defaults["fused"]  # auto: loop on a CPU
    assert build_optimizer(model, OptimizerConfig(name="adamw", implementation="foreach")).defaults["foreach"]


def test_on_a_resize_adam_takes_the_square_root_rule_and_sgd_the_linear_one():
    assert OptimizerConfig(name="adamw").resize_rule == "sqrt"
    assert OptimizerConfig(name="sgd").resize_rule == "linear"
    assert TorchOptimizerConfig(name="torch.optim.Adam").resize_rule == "sqrt"
    assert OptimizerConfig(name="adamw", lr_scaling="linear").resize_rule == "linear"
    assert batch_for(2, 32, 4, "keep_worker", "sqrt") == (64, math.sqrt(0.5))
    assert batch_for(8, 32, 4, "keep_worker", "linear") == (256, 2.0)
    assert batch_for(8, 32, 4, "keep_worker", "none") == (256, 1.0)
    assert batch_for(8, 32, 4, "keep_global", "sqrt") == (128, 1.0)
