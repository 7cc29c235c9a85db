"""Loading a workload factory (`module:function`) the way a job does: the working directory first."""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from core.schema import ConfigError


def check_factory(spec: str) -> Callable[..., Any]:
    """Import `module:function` (cwd first on sys.path, as under `ray job submit`)."""
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is bad input
        raise ConfigError(f"workload.factory: cannot import module {module_name!r}: {type(err).__name__}: {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"workload.factory: module {module_name!r} has no function {attr!r}")
    return factory
