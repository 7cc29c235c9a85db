"""YAML -> validated `JobConfig`: file reading, `--set key=value` overrides, factory checks.

Validation happens here, before any Ray call or process group, so that every mistake a user
can make in a config is reported as one `ConfigError` line naming the key (or the YAML line
and column) and nothing has started or been written.
"""
from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from core.factory import check_factory
from core.schema import ConfigError, JobConfig, TorchOptimizerConfig, parse, system_keys

Overrides = Mapping[str, Any] | Iterable[str]


def load_config(path: str | os.PathLike, overrides: Overrides = ()) -> JobConfig:
    """Read a YAML config, apply `key.sub=value` overrides, validate everything."""
    raw = read_yaml(Path(path))
    return config_from_dict(raw, overrides)


def config_from_dict(raw: Any, overrides: Overrides = ()) -> JobConfig:
    """Validate a plain mapping (the YAML's content) with overrides applied."""
    if raw is None:
        raise ConfigError("config: the file is empty; it needs at least name, workload and stop")
    if not isinstance(raw, dict):
        raise ConfigError(f"config: the top level must be a mapping of keys, got {type(raw).__name__}")
    data = copy.deepcopy(raw)
    for key, value in _override_items(overrides):
        _set_path(data, key, value)
    for required in ("name", "workload"):
        if required not in data:
            raise ConfigError(f"{required}: missing; every config needs name, workload and stop")
    for key in system_keys(JobConfig):
        if data.get(key):  # empty, as a resolved config.yaml of a run without `auto` has it: nothing to refuse
            raise ConfigError(f"{key}: is set by the job itself when sync.policy: auto picks (a run's config.yaml "
                              f"records it), never by a config; remove it")
    config = parse(JobConfig, data)
    check_factory(config.workload.factory, config.workload.params)
    if isinstance(config.optimizer, TorchOptimizerConfig):
        from algorithms.policies.optim import check_optimizer  # imports torch: only for a torch.optim name

        check_optimizer(config.optimizer)
    if config.training.compile:
        from actors.training.compiled import check_backend  # imports torch: only for a compiled model

        check_backend(config.training.compile_backend)
    if config.training.precision == "bf16" and config.optimizer.adam_family:
        print(f"warning: training.precision: bf16 keeps {config.optimizer.name}'s weights and state in bfloat16, whose "
              f"8-bit mantissa loses any update under 1/256 of a weight (at lr {config.optimizer.lr:g}, most of them: "
              f"LayerNorm gains barely move); bf16-mixed keeps float32 weights", file=sys.stderr)
    if config.storage is not None and ("://" not in config.storage or config.storage.startswith("file://")):
        local = str(Path(config.storage.removeprefix("file://")).expanduser().resolve())
        if config.run_dir is not None and str(Path(config.run_dir).expanduser().resolve()) != local:
            raise ConfigError(f"storage: a local path is the run root, and run_dir names another ({config.run_dir}); "
                              f"set one of them")
        config.run_dir, config.storage = local, None
    if config.run_dir is not None:
        config.run_dir = str(Path(config.run_dir).expanduser().resolve())
    if config.storage is not None:  # credentials in the URI: held in this process's memory, not the config
        from actors.runs import credentials
        from actors.runs.storage import move_credentials

        config.storage, options, values = move_credentials(config.storage)
        config.storage_options = {**config.storage_options, **options}
        credentials.hold(values)
    return config


def read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"config: file not found: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise ConfigError(f"{path}: YAML syntax error at {where}: {err.problem or err.context}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot parse YAML: {str(err).splitlines()[0]}") from None


def _override_items(overrides: Overrides) -> list[tuple[str, Any]]:
    if isinstance(overrides, Mapping):
        return list(overrides.items())
    items = []
    for text in overrides:
        if "=" not in text:
            raise ConfigError(f"--set {text!r}: expected key.sub=value")
        key, _, value = text.partition("=")
        try:
            items.append((key.strip(), yaml.safe_load(value) if value.strip() else None))
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: cannot parse value {value!r} as YAML") from None
    return items


def _set_path(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"--set {dotted!r}: empty key segment")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a mapping, cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def default_run_root() -> Path:
    return Path(os.environ.get("ORCHESTRATOR_RUN_ROOT", Path.home() / "orchestrator-runs")).expanduser().resolve()
