"""Elastic distributed training on Ray and PyTorch: the driver side and everything a user touches."""
from core.schema import ConfigError, JobConfig, JobResult, JobStatus, OrchestratorError
from orchestrator.config import load_config

__all__ = ["load_config", "collective_group", "ElasticJob", "JobConfig", "JobStatus", "JobResult", "ConfigError", "OrchestratorError"]


def collective_group() -> str:
    """Inside a workload's code on a worker: the name of the worker's current membership epoch's
    group, for `ray.util.collective` calls (`allreduce(t, group_name=collective_group())`). The name
    changes at every membership change; operations on it have the job's timeout and fail at once
    when the epoch is aborted (the step is then redone in the next epoch)."""
    from actors.collective import current_group

    return current_group()


def __getattr__(name: str):
    if name == "ElasticJob":  # imported lazily: `load_config` must not import Ray
        from orchestrator.job import ElasticJob

        return ElasticJob
    raise AttributeError(name)
