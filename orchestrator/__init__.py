"""Elastic distributed training on Ray and PyTorch: the driver side and everything a user touches."""
import importlib as _importlib
import os as _os
import sys as _sys

PROJECT_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
"""The directory this project's top-level packages (`core`, `actors`, `algorithms`, `orchestrator`) are
in: the repository for an editable install, else site-packages."""
OWN_PACKAGES = ("core", "actors", "algorithms")


def _own_packages_first() -> None:
    """Import this project's `core`, `actors` and `algorithms` from PROJECT_ROOT before anything else can.

    `python -m orchestrator`, a notebook and a user's script put the working directory first on
    `sys.path`, and the workload loader adds it too (core/factory.py): a user project with packages of
    those common names would replace this project's modules. Once ours are in `sys.modules`, every
    `import actors.x` resolves inside them, whatever comes first on the path later. The user's own
    packages of those names cannot be imported at the same time (one name, one module); their workload
    modules can. Raises ImportError if another package of one of those names was imported already."""
    saved = list(_sys.path)
    here = _os.getcwd()
    _sys.path[:] = [PROJECT_ROOT] + [p for p in saved if _os.path.abspath(p or ".") != here]
    try:
        for name in OWN_PACKAGES:
            module = _sys.modules.get(name) or _importlib.import_module(name)
            where = _os.path.dirname(_os.path.dirname(_os.path.abspath(getattr(module, "__file__", "") or "")))
            if where != PROJECT_ROOT:
                raise ImportError(f"a package named {name!r} from {where} was imported before this project's "
                                  f"({PROJECT_ROOT}); rename yours or import orchestrator first")
    finally:
        _sys.path[:] = saved


_own_packages_first()

from core.schema import ConfigError, JobConfig, JobStatus, OrchestratorError  # noqa: E402
from orchestrator import remote as _remote  # noqa: E402,F401 - the actor classes' module, for Ray's pickling by name
from orchestrator.config import load_config  # noqa: E402
from orchestrator.results import RunResult as JobResult  # noqa: E402 - what `wait()` returns: its `model()` too
from orchestrator.results import load_model  # noqa: E402

__all__ = ["load_config", "load_model", "collective_group", "ElasticJob", "JobConfig", "JobStatus", "JobResult",
           "ConfigError", "OrchestratorError"]


def collective_group() -> str:
    """Inside a workload's code on a worker: the name of the worker's current membership epoch's
    group, for `ray.util.collective` calls (`allreduce(t, group_name=collective_group())`). The name
    changes at every membership change; operations on it have the job's timeout and fail at once
    when the epoch is aborted (the step is then redone in the next epoch)."""
    from actors.transport.collective import current_group

    return current_group()


def __getattr__(name: str):
    if name == "ElasticJob":  # imported lazily: `load_config` must not import Ray
        from orchestrator.job import ElasticJob

        return ElasticJob
    raise AttributeError(name)
