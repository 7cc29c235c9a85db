"""The size of the local Ray a job starts for itself (orchestrator/connection.py): no Ray started here."""
from __future__ import annotations

from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from orchestrator.connection import local_cpus


def job(workers: dict, **over) -> JobConfig:
    cfg = {"name": "size", "workers": workers, "workload": {"factory": "orchestrator.workloads.digits:mlp"}, **over}
    return parse(JobConfig, config_from_dict(cfg).to_dict())


def test_a_local_ray_holds_workers_max_and_the_hot_spares():
    """count 2, max 3, one spare: 4 CPUs. A local Ray has no autoscaler: sized for `max` alone, the spare
    took the room of the third worker, and a scale to `max` asked for an actor that could never be placed."""
    assert local_cpus(job({"count": 2, "max": 3, "spares": 1})) == 4
    assert local_cpus(job({"count": 2, "max": 3})) == 3
    assert local_cpus(job({"count": 2, "spares": 2, "cpus": 0.5})) == 2
    assert local_cpus(job({"count": 2, "spares": 1}, ray={"num_cpus": 16})) == 16, "ray.num_cpus when larger"
    assert local_cpus(None) == 1
