"""Every policy kind's final model carries the model's buffers (a BatchNorm layer's running statistics
and batch count), not their initial values, in process: real replicas in threads over in-process gloo
(the parameter server in process for the server kinds). The final model is put together as the
coordinator's ending does for the kind (`algorithms.rules.kinds`' `final_model`): the replicas' committed
states averaged, rank 0's state, or the server's model. Through Ray, the `server` and `background`
kinds' jobs: tests/e2e/test_buffers.py."""
from __future__ import annotations

import io

import pytest
import torch

from actors.runs import checkpoints
from algorithms.rules.kinds import PolicyTraits
from orchestrator.workloads.digits import bn_mlp
from testkit.harness import LocalJob, assert_batchnorm_trained

KINDS = {"synchronous": {"policy": "bsp"}, "periodic": {"policy": "local_sgd", "h": 4},
         "decentralized": {"policy": "dpsgd"}, "background": {"policy": "shadow", "method": "ma"},
         "server": {"policy": "asp"}}
STEPS = 60


def final_model(job: LocalJob, policy: str, slots: list[str]) -> bytes:
    """As `actors.control.endings.final_model` chooses it for the kind."""
    if PolicyTraits(policy).final_model.averages_replicas:
        return checkpoints.average_states([job.replicas[s].final_state() for s in slots])
    if job.server is not None:
        return job.server.model_state()
    return job.replicas[slots[0]].final_state()


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_final_model_of_every_policy_kind_carries_its_buffers(tmp_path, kind):
    cfg = {"name": f"bn-{kind}", "seed": 2, "workers": {"count": 2, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:bn_mlp", "batch_size": 16},
           "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.5}, "sync": KINDS[kind], "stop": {"max_steps": STEPS},
           "eval_every": 0}
    slots = ["w0", "w1"]
    job = LocalJob(cfg, slots, str(tmp_path))
    job.run(tuple(slots), 32)
    model = bn_mlp().model
    model.load_state_dict(torch.load(io.BytesIO(final_model(job, KINDS[kind]["policy"], slots)), weights_only=True)["model"])
    assert_batchnorm_trained(model, KINDS[kind]["policy"])
