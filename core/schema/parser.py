"""The YAML parser: plain data in, validated config dataclasses out (`parse`).

It reads each dataclass's type hints and converts every value to its field's type, rejecting unknown
keys, wrong types and non-finite numbers (NaN, infinities) with a `ConfigError` that names the key
path (and the nearest allowed key, for a misspelt one); `sync:` is parsed by its policy, `optimizer:` by
its name.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, Union

from core.schema.errors import ConfigError, FieldError, nearest
from core.schema.policies import SYNC_POLICIES, AutoConfig, SyncConfig
from core.schema.workload import BUILT_IN_OPTIMIZERS, Optimizer, OptimizerConfig, TorchOptimizerConfig

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number written the way people write them (1e-5, 3., .5), for float fields."""

_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


SYSTEM_SET = types.MappingProxyType({"system_set": True})
"""A field's `metadata` for a value the job sets itself (what `sync.policy: auto` picked): kept in the
config the actors are handed, never written by a user, so it is left out of the keys an error lists
(`user_keys`) and a user's file that sets it is refused (orchestrator/config.py)."""


def user_keys(cls: type) -> list[str]:
    """The keys of dataclass `cls` a user may write: its fields less the `SYSTEM_SET` ones."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("system_set")]


def system_keys(cls: type) -> list[str]:
    """The `SYSTEM_SET` fields of dataclass `cls`."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("system_set")]


def _suggest(key: str, allowed: list[str], listed_as: str) -> str:
    """ "did you mean X? (<listed_as>: ...)" for a near miss, else "<listed_as>: ..." ."""
    near = nearest(key, allowed)
    listing = f"{listed_as}: {', '.join(allowed)}"
    return f"did you mean {near}? ({listing})" if near else listing


def parse(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from plain YAML data, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"{key_path}: unknown key; {_suggest(str(key), user_keys(cls), 'allowed here')}")
        kwargs[key] = _convert(hints[key], value, key_path)
    try:
        return cls(**kwargs)
    except FieldError as err:
        key_path = f"{path}.{err.field_name}" if path else err.field_name
        raise ConfigError(f"{key_path}: {err.message}") from None


def _parse_sync(data: Any, path: str) -> Any:
    """`sync:` is parsed by its `policy`: each policy has its own knobs."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {_show(data)}")
    policy = data.get("policy", "bsp")
    if policy not in SYNC_POLICIES and policy != "auto":
        raise ConfigError(f"{path}.policy: unknown policy {policy!r}; available: {', '.join(sorted(SYNC_POLICIES))}, "
                          f"or auto")
    cls = AutoConfig if policy == "auto" else SYNC_POLICIES[policy]
    knobs = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in knobs:
            raise ConfigError(f"{path}.{key}: is not a knob of policy {policy!r}; {_suggest(str(key), knobs, 'its knobs')}")
    return parse(cls, data, path)


def _parse_optimizer(data: Any, path: str) -> Any:
    """`optimizer:` is parsed by its `name`: `sgd` and `adamw` take this project's knobs; any other name is
    a torch.optim class, whose keyword arguments are written beside it (or under `args:`) and gathered
    into `args` (checked against the class when the config is loaded: orchestrator/config.py)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {_show(data)}")
    name = data.get("name", "sgd")
    if not isinstance(name, str):
        raise ConfigError(f"{path}.name: expected {' or '.join(BUILT_IN_OPTIMIZERS)} or a torch.optim class name "
                          f"(Adagrad, torch.optim.RMSprop), got {_show(name)}")
    if name in BUILT_IN_OPTIMIZERS:
        return parse(OptimizerConfig, data, path)
    own = set(user_keys(TorchOptimizerConfig))
    args = _convert(dict, data.get("args", {}), f"{path}.args")
    for key, value in data.items():
        if key in own:
            continue
        if key in args:
            raise ConfigError(f"{path}.{key}: given twice, beside name and under args; keep one")
        args[key] = value
    return parse(TorchOptimizerConfig, {**{k: v for k, v in data.items() if k in own}, "args": args}, path)


def _convert(tp: Any, value: Any, path: str) -> Any:
    if tp is SyncConfig:
        return _parse_sync(value, path)
    if tp is Optimizer:
        return _parse_optimizer(value, path)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {_show(value)} is not allowed; choose one of: {', '.join(map(str, allowed))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        parts = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(parts):
            raise ConfigError(f"{path}: expected a list of {len(parts)} numbers, got {_show(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(parts, value)))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # an annotation: a dataclass here is a class
        return parse(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string; it is a number here
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_show(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer with hundreds of digits
            number = math.inf
        if not math.isfinite(number):  # YAML's .nan and .inf, or 1e400 written out: no knob means them
            raise ConfigError(f"{path}: must be a finite number, got {number}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_show(value)}")
        return value
    raise TypeError(f"schema type {tp!r} at {path} has no converter")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "nothing (null)"
