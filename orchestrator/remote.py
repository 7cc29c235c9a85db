"""Where Ray finds this project's actor classes: the worker, the coordinator, the parameter server, the
data holder and the cluster probe, each imported on first use (the coordinator's process never loads
torch, which the worker's module does).

Ray starts each actor by importing its class's module by name in a fresh worker process, whose
`sys.path` has the driver's working directory first. A user project holding `core/`, `actors/` or
`algorithms/` packages (common names) would replace this project's there, and the actor would fail to
import. Each of those classes names this module as its own (`__module__`), so a worker process imports
`orchestrator` first, whose `__init__` imports this project's `core`, `actors` and `algorithms` from
its own directory before anything on the path can stand in for them (`_own_packages_first`).
"""
from __future__ import annotations

import importlib
from typing import Any

CLASSES = {"Worker": "actors.training.worker", "Coordinator": "actors.control.coordinator", "ParameterServer": "actors.server.server_actor",
           "DataHolder": "actors.training.data_holder", "Probe": "actors.training.probe"}
"""Each actor class by name, and the module that defines it."""


def __getattr__(name: str) -> Any:
    module = CLASSES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
