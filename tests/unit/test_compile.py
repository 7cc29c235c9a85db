"""`training.compile`: the model's call compiled in place, the training it does unchanged, and a hot spare's
warm-up compiling ahead so that its first step compiles nothing, whatever its share of the global batch.

Dynamo's `aot_eager` backend traces the forward and the backward as `inductor` does, without generating
C++ (seconds of a compiler per graph on this machine's CPU); what these tests check is the same."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from actors.training.workload import build_workload, split_loss, warm_up
from core.schema import ConfigError, JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.in_process import LocalJob

BN_MLP = "orchestrator.workloads.digits:bn_mlp"  # a BatchNorm: buffers the warm-up's forward must not move


def config(compile_: bool, policy: str = "bsp", steps: int = 6) -> dict:
    return {"name": "compiled", "seed": 3, "workers": {"count": 2, "cpus": 0.5},
            "workload": {"factory": BN_MLP, "batch_size": 8}, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "sync": {"policy": policy}, "stop": {"max_steps": steps}, "eval_every": 0,
            "training": {"compile": compile_, "compile_backend": "aot_eager"}}


def frames() -> int:
    """Frames Dynamo compiled in this process so far."""
    return int(counters["frames"]["ok"])


def one_step(workload, rows: int) -> None:
    x, y = workload.train_data[0:rows]
    loss, _ = split_loss(workload.loss(workload.model, (x, y)))
    loss.backward()


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_a_spare_warmed_up_compiles_nothing_on_its_first_step_and_its_model_is_as_built():
    cfg = parse(JobConfig, config(True))
    torch._dynamo.reset()
    cold = build_workload(cfg)  # a joiner that was not warmed: its first step compiles
    before = frames()
    one_step(cold, 5)
    assert frames() > before, "an unwarmed compiled model's first step compiled nothing: nothing was compiled"

    torch._dynamo.reset()
    spare = build_workload(cfg)
    built = state(spare.model)
    warm_up(cfg, spare, torch.device("cpu"))
    assert frames() > before, "the warm-up compiled nothing"
    after = state(spare.model)
    assert built.keys() == after.keys()  # the state's names are the module's own
    for name, tensor in built.items():  # the BatchNorm's running statistics too
        assert torch.equal(tensor, after[name]), f"the warm-up moved {name}"
    assert all(p.grad is None for p in spare.model.parameters())
    warmed = frames()
    for rows in (5, 11, 8):  # a share of any size after a resize: the batch dimension was compiled dynamic
        one_step(spare, rows)
    assert frames() == warmed, f"the warmed spare compiled {frames() - warmed} frame(s) on its steps"


def test_bsp_with_a_compiled_model_trains_as_without(tmp_path):
    finals = {}
    for compile_ in (False, True):
        torch._dynamo.reset()
        job = LocalJob(config(compile_), ["w0", "w1"], str(tmp_path / str(compile_)))
        job.run(("w0", "w1"), 16)
        finals[compile_] = job.agreed_parameters(["w0", "w1"])
        assert job.replicas["w0"].training.model._compiled_call_impl is not None or not compile_
    diff = max(float((a - b).abs().max()) for a, b in zip(finals[False], finals[True]))
    print(f"BSP, 2 members, 6 steps, compiled (aot_eager) vs eager: max parameter difference {diff:.2e}")
    assert diff < 1e-5


def test_an_unknown_backend_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        config_from_dict({**config(True), "training": {"compile": True, "compile_backend": "no_such_backend"}})
    assert "training.compile_backend" in str(refused.value) and "\n" not in str(refused.value)
