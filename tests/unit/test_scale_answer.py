"""What `ElasticJob.scale` answers (orchestrator/job.py): the coordinator's status once the plan of `count`
members is out, or an error naming what is missing. No Ray: the coordinator's answer is given."""
from __future__ import annotations

import pytest

from core.schema import JobStatus, MemberStatus, OrchestratorError
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob


def answer(world: int, members: tuple[MemberStatus, ...], state: str = "RUNNING", spares: tuple = (),
           departed: tuple = ()) -> dict:
    return JobStatus(name="j", run_id="r", state=state, step=9, membership_epoch=2, world_size=world, members=members,
                     loss=None, throughput=None, cause=None, run_dir="/tmp/r", spares=spares,
                     departed=departed).to_dict()


def job_answering(status: dict) -> ElasticJob:
    job = ElasticJob(config_from_dict({"name": "j", "workers": {"count": 2, "max": 3},
                                       "workload": {"factory": "orchestrator.workloads.digits:mlp"}}))
    job._coordinator = object()  # type: ignore[assignment]  # running: its answer is `status`
    job._ask = lambda call, timeout=30.0: status  # type: ignore[method-assign]
    return job


TRAINING = (MemberStatus("w0", 0, "n", 1, "training"), MemberStatus("w1", 1, "n", 2, "training"))


def test_a_scale_whose_joiner_cannot_be_placed_is_not_answered_as_done():
    """Before, `scale(3)` returned at once with w2 still starting, and a hang looked like success."""
    w2 = MemberStatus("w2", -1, "", 0, "starting", cause="cannot be placed: it needs 1 CPUs, the cluster has 0 CPUs free")
    spare = {"name": "spare2", "state": "starting", "pid": 0, "node": "", "cause": "cannot be placed: it needs 1 CPUs, "
                                                                               "the cluster has 0 CPUs free"}
    with pytest.raises(OrchestratorError) as err:
        job_answering(answer(2, (*TRAINING, w2), spares=(spare,))).scale(3)
    assert str(err.value).startswith("scale to 3: the job has 2 members now; w2 starting (cannot be placed: it needs "
                                     "1 CPUs, the cluster has 0 CPUs free); hot spare spare2 cannot be placed"), err.value
    assert "joins once Ray can place it" in str(err.value)


def test_a_scale_whose_joiner_was_retired_names_why():
    gone = MemberStatus("w2", -1, "", 0, "retired", cause="retired after 3 failures; last: ValueError: no")
    with pytest.raises(OrchestratorError, match="w2 retired: retired after 3 failures; last: ValueError: no"):
        job_answering(answer(2, (*TRAINING, gone), departed=(gone,))).scale(3)


def test_a_scale_that_reached_its_count_or_a_job_that_ended_answers_the_status():
    w2 = MemberStatus("w2", 2, "n", 3, "training")
    assert job_answering(answer(3, (*TRAINING, w2))).scale(3).world_size == 3
    assert job_answering(answer(2, TRAINING, state="FINISHED")).scale(3).state == "FINISHED"
    assert job_answering(answer(2, (*TRAINING, w2))).scale(3, wait=False).world_size == 2, "decided, not waited for"
