"""Loading a workload factory (`module:function`) the way a job does: the working directory first; and
checking the config's `workload.params` against its signature before anything starts."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from core.schema import ConfigError
from core.schema.errors import nearest


def check_factory(spec: str, params: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Import `module:function` (cwd first on sys.path, as under `ray job submit`); with `params`, check
    them against its signature (`check_params`)."""
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
    if params is not None:
        check_params(spec, factory, params)
    return factory


def check_params(spec: str, factory: Callable[..., Any], params: Mapping[str, Any]) -> None:
    """ConfigError (one line naming `workload.params.<name>`) for a parameter the factory does not take
    (the nearest it takes suggested) or one it needs that is missing: found at validation, not in every
    worker's start. A factory taking `**kwargs` accepts any name; one whose signature cannot be read (a
    builtin) is not checked."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    by_name = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = [p.name for p in by_name]
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        for name in params:
            if name not in names:
                hint = nearest(name, names)
                takes = f"did you mean {hint!r}?" if hint else f"it takes {', '.join(names)}" if names else "it takes none"
                raise ConfigError(f"workload.params.{name}: the factory {spec} takes no parameter {name!r}; {takes}")
    missing = [p.name for p in by_name if p.default is p.empty and p.name not in params]
    if missing:
        raise ConfigError(f"workload.params.{missing[0]}: missing; the factory {spec} needs it (it has no default)")
