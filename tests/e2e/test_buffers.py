"""Every policy kind's final model carries the model's buffers (a BatchNorm layer's running statistics
and batch count), not their initial values: a BatchNorm model evaluated in eval mode depends on them.
The server kinds keep each member's newest buffers (sent with its pushes) and the final model takes
their floating-point ones averaged over the members, the others from the lowest-ranked member.

Through Ray in the default tier: the `server` kind (the final model from the parameter server actor) and
the `background` kind (the replicas' states averaged by the coordinator); the other kinds in the slow
tier. Every kind in process: tests/unit/test_final_model_buffers.py."""
from __future__ import annotations

import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import assert_batchnorm_trained

KINDS = {"synchronous": {"policy": "bsp"}, "periodic": {"policy": "local_sgd", "h": 4},
         "decentralized": {"policy": "dpsgd"}, "background": {"policy": "shadow", "method": "ma"},
         "server": {"policy": "asp"}}


DEFAULT_KINDS = ("background", "server")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k in DEFAULT_KINDS else pytest.mark.slow) for k in KINDS])
def test_the_final_model_of_every_policy_kind_carries_its_buffers(run_root, kind):
    steps = 60
    cfg = {"name": f"bn-{kind}", "seed": 2, "workers": {"count": 2, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:bn_mlp", "batch_size": 16},
           "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.5}, "sync": KINDS[kind], "stop": {"max_steps": steps},
           "server": {"cpus": 0.5}, "eval_every": 0}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=120)
    assert result.state == "FINISHED", result
    model = job.model()
    assert_batchnorm_trained(model, KINDS[kind]["policy"])
