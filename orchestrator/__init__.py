"""Elastic distributed training on Ray and PyTorch: the driver side and everything a user touches."""
from orchestrator.config import load_config
from core.schema import ConfigError, JobConfig, JobResult, JobStatus, OrchestratorError

__all__ = ["load_config", "ElasticJob", "JobConfig", "JobStatus", "JobResult", "ConfigError", "OrchestratorError"]


def __getattr__(name: str):
    if name == "ElasticJob":  # imported lazily: `load_config` must not import Ray
        from orchestrator.job import ElasticJob

        return ElasticJob
    raise AttributeError(name)
