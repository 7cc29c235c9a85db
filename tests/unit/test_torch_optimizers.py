"""Any torch.optim optimizer by name (`optimizer: {name: Adagrad, lr: 0.01, lr_decay: 0.001}`): parsed by
its name with its arguments beside it, checked against torch when the config is loaded (one line, the
nearest name), refused where the policy cannot run it, and trained by the policies that update on the
workers exactly as torch's own optimizer on the references of tests/unit/test_policy_oracles.py and
tests/unit/test_gossip.py (real replicas in threads, no Ray)."""
from __future__ import annotations

import io

import pytest
import torch

from algorithms.policies.optim import SGD, build_optimizer
from core.schema import ConfigError, JobConfig, OptimizerConfig, TorchOptimizerConfig, parse
from orchestrator.config import config_from_dict
from testkit.harness import LocalJob
from tests.unit.test_gossip import reference_gossip, run_gossip
from tests.unit.test_policy_oracles import config, max_diff, reference_bsp, reference_periodic, run

ADAGRAD = {"name": "Adagrad", "lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}
RMSPROP = {"name": "torch.optim.RMSprop", "lr": 0.005, "alpha": 0.9, "momentum": 0.5}
FACTORY = {"factory": "orchestrator.workloads.digits:mlp"}


def job(optimizer: dict, **more) -> dict:
    return {"name": "opt", "workload": FACTORY, "optimizer": optimizer, "stop": {"max_steps": 5}, **more}


def test_a_torch_optimizer_is_parsed_by_name_with_its_arguments_beside_it_and_survives_the_round_trip():
    cfg = config_from_dict(job(ADAGRAD))
    assert cfg.optimizer == TorchOptimizerConfig(name="Adagrad", lr=0.05,
                                                 args={"lr_decay": 0.01, "initial_accumulator_value": 0.1})
    assert parse(JobConfig, cfg.to_dict()).optimizer == cfg.optimizer, "the actors parse the config's dict again"
    assert config_from_dict(job({"name": "Adagrad", "lr": 0.05, "args": {"lr_decay": 0.01,
                                 "initial_accumulator_value": 0.1}})).optimizer == cfg.optimizer
    with pytest.raises(ConfigError, match=r"^optimizer.lr_decay: given twice, beside name and under args; keep one$"):
        config_from_dict(job({"name": "Adagrad", "lr_decay": 0.1, "args": {"lr_decay": 0.2}}))
    assert isinstance(config_from_dict(job({"name": "sgd"})).optimizer, OptimizerConfig), "sgd keeps its own knobs"


@pytest.mark.parametrize("optimizer,more,line", [
    ({"name": "adagrad"}, {}, "optimizer.name: 'adagrad' is not an optimizer of torch.optim; did you mean Adagrad? "
                              "(choose sgd or adamw, or one of: "),
    ({"name": "sdg"}, {}, "optimizer.name: 'sdg' is not an optimizer of torch.optim; did you mean sgd?"),
    ({"name": "Adagrad", "lr_decy": 0.1}, {}, "optimizer.lr_decy: Adagrad takes no argument 'lr_decy'; did you mean "
                                              "lr_decay? (its arguments: lr_decay, weight_decay, "),
    ({"name": "Adam", "betas": [1.5, 0.9]}, {}, "optimizer: Adam(lr=0.1, betas=[1.5, 0.9]) fails on a two-element "
                                                "parameter: Invalid beta parameter at index 0: 1.5"),
    ({"name": "LBFGS"}, {}, "optimizer.name: LBFGS cannot take a training step (one step() on a dense gradient, no "
                            "closure): "),
    ({"name": "SparseAdam"}, {}, "optimizer.name: SparseAdam cannot take a training step"),
    ({"name": "Adam", "eps": float("nan")}, {}, "optimizer.eps: must be a finite number, got nan"),
    ({"name": "Adam"}, {"sync": {"policy": "asp"}}, "optimizer.name: policy 'asp' updates on its parameter server"),
    ({"name": "AdamW"}, {"sync": {"policy": "qadam"}}, "optimizer.name: qadam is Adam: set optimizer.name: adamw"),
    ({"name": 3}, {}, "optimizer.name: expected sgd or adamw or a torch.optim class name"),
])
def test_config_load_refuses_a_torch_optimizer_mistake_in_one_line(optimizer, more, line):
    with pytest.raises(ConfigError) as err:
        config_from_dict(job(optimizer, **more))
    assert str(err.value).startswith(line), str(err.value)
    assert "\n" not in str(err.value)


def test_sgd_and_adamw_keep_their_fast_paths_and_a_torch_name_builds_that_class():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert type(build_optimizer(params, OptimizerConfig(name="sgd", momentum=0.9))) is SGD
    assert type(build_optimizer(params, OptimizerConfig(name="adamw"))) is torch.optim.AdamW
    built = build_optimizer(params, config_from_dict(job(RMSPROP)).optimizer)
    assert type(built) is torch.optim.RMSprop and built.defaults["alpha"] == 0.9 and built.defaults["momentum"] == 0.5


@pytest.mark.parametrize("optimizer", [ADAGRAD, RMSPROP], ids=["adagrad", "rmsprop"])
def test_bsp_with_a_torch_optimizer_equals_single_process(tmp_path, optimizer):
    diff = max_diff(run(tmp_path, {"policy": "bsp", "bucket_mb": 0.004}, optimizer, 3, 50),
                    reference_bsp(optimizer, 50))
    assert diff < 1e-6, diff


def test_local_sgd_with_a_torch_optimizer_as_the_inner_one_equals_the_n_replica_simulation(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "local_sgd", "h": 4}, ADAGRAD, 3, 50),
                    reference_periodic(ADAGRAD, 3, 50, h=4))
    assert diff < 1e-5, diff


def test_dpsgd_with_a_torch_optimizer_equals_the_n_replica_simulation(tmp_path):
    mine = run_gossip(tmp_path, {"policy": "dpsgd", "topology": {"kind": "ring"}}, RMSPROP, 4, 64)
    ref = reference_gossip("ring", RMSPROP, 4, 64)
    assert max(max_diff(a, b) for a, b in zip(mine, ref)) < 1e-5


def test_a_torch_optimizers_state_travels_in_the_state_a_joiner_or_a_checkpoint_loads(tmp_path):
    """The committed state (what a joiner receives, a checkpoint holds, `model.pt`) carries the torch
    optimizer's state, and it loads with `weights_only=True` into the optimizer of a fresh replica."""
    cfg = config({"policy": "bsp"}, ADAGRAD, steps=4, n=2)
    trained = LocalJob(cfg, ["w0", "w1"], str(tmp_path / "a"))
    trained.run(("w0", "w1"), 32)
    blob = trained.replicas["w0"].committed.state_bytes()
    assert torch.load(io.BytesIO(blob), weights_only=True)["optimizer"]["param_groups"][0]["lr_decay"] == 0.01
    fresh = LocalJob(cfg, ["w0"], str(tmp_path / "b")).replicas["w0"]
    fresh.committed.load_state_bytes(blob)
    mine, theirs = fresh.training.optimizer.state_dict()["state"], trained.replicas["w0"].training.optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys() and len(mine) > 0
    assert all(torch.equal(mine[k]["sum"], theirs[k]["sum"]) for k in mine)
    assert type(fresh.training.optimizer.inner) is torch.optim.Adagrad  # behind the clipping and precision guard


def test_shadow_trains_with_a_torch_optimizer(tmp_path):
    """The background kind (its foreground steps with the configured optimizer on each member)."""
    cfg = config({"policy": "shadow", "method": "ma"}, RMSPROP, steps=6, n=2)
    job_ = LocalJob(cfg, ["w0", "w1"], str(tmp_path))
    before = [p.detach().clone() for p in job_.replicas["w0"].training.model.parameters()]
    job_.run(("w0", "w1"), 32)
    assert type(job_.replicas["w0"].training.optimizer.inner) is torch.optim.RMSprop
    assert max_diff(before, job_.parameters("w0")) > 0
