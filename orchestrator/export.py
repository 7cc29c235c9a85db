"""`python -m orchestrator export RUN_DIR --hf OUT`: a run's model as a Hugging Face model folder.

The model is the run's final one (`orchestrator.results.load_model`), or a committed checkpoint of
the run (`--checkpoint`: its step, found in the run folder's `checkpoints/` or, for a run kept on
remote storage, there; or its data file), read once and checked against its manifest
(`actors.runs.checkpoints.read_verified`) and loaded into the workload's model rebuilt from the run's
`config.yaml`. Only a `transformers` model can be written in that format: `save_pretrained` (weights
as safetensors, tied weights kept tied) and, when a tokenizer is known (`tokenizer`, else the one in
the manifest of the prepared folder the workload's `data_dir` parameter names), the tokenizer beside
it, its end-of-text id set as the model's where the model has none (so `generate` stops there).
Everything is written into a temporary folder beside OUT and renamed to OUT at the end.
"""
from __future__ import annotations

import importlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from actors.runs.storage import Storage, first_line, is_remote, open_storage
from core.schema import ConfigError, JobConfig, OrchestratorError, parse
from orchestrator.data.manifest import read_manifest
from orchestrator.prepare import publish
from orchestrator.results import load_model, rebuild_model

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class Exported:
    folder: Path
    model: str
    """Which model: "the final model" or "the checkpoint of step N"."""
    tokenizer: Path | None


def _transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise ConfigError(f"export --hf: needs the transformers package ({err}): pip install -e '.[hf]'") from None


def _config(run: Path) -> JobConfig:
    try:
        return parse(JobConfig, yaml.safe_load((run / "config.yaml").read_text()))
    except OSError as err:
        raise ConfigError(f"export: {run / 'config.yaml'}: {err.strerror or err} (RUN_DIR is a run folder: "
                          f"<run root>/<job>/<run id>, which `run` prints)") from None


def _checkpoint_folder(run: Path, config: JobConfig) -> tuple[Storage, str]:
    """Where the run's checkpoints are: its folder's `checkpoints/`, else the job's remote storage."""
    if (run / "checkpoints").is_dir() or not is_remote(config.storage):
        return open_storage(str(run)), "checkpoints"
    return open_storage(str(config.storage), config.storage_options), f"{config.name}/{run.name}/checkpoints"


def _checkpoint_bytes(run: Path, config: JobConfig, which: str) -> tuple[bytes, str]:
    """(the state's bytes, which checkpoint) of `--checkpoint which`: a step, or a data file's path or URI."""
    from actors.runs import checkpoints

    if which.isdigit():
        storage, folder = _checkpoint_folder(run, config)
        try:
            info = json.loads(storage.read(f"{folder}/{checkpoints.manifest_name(int(which))}"))
        except (OSError, ValueError):
            steps = sorted(int(m.group(1)) for key, _ in storage.list(folder)
                           if (m := checkpoints.MANIFEST.fullmatch(key.rsplit("/", 1)[-1])))
            raise ConfigError(f"export --checkpoint {which}: no checkpoint of step {which} in {storage.location(folder)} "
                              f"(steps there: {', '.join(map(str, steps)) or 'none'})") from None
        location = storage.location(f"{folder}/{info.get('file', '')}")
    else:
        location = which if is_remote(which) else str(Path(which).expanduser().absolute())
        storage = open_storage(location.rsplit("/", 1)[0])
    try:
        data = checkpoints.read_verified(storage, location)
    except (RuntimeError, OSError) as err:
        raise ConfigError(f"export --checkpoint {which}: {location}: {first_line(err)}") from None
    named = checkpoints.DATA.fullmatch(location.rsplit("/", 1)[-1])  # read_verified took only such a name
    return data, f"the checkpoint of step {int(named.group(1)) if named else which}"


def _model(run: Path, config: JobConfig, checkpoint: str | None) -> tuple[torch.nn.Module, str]:
    from actors.training.user_code import WorkloadBug

    try:
        if checkpoint is None:
            return load_model(run), "the final model"
        data, which = _checkpoint_bytes(run, config, checkpoint)
        return rebuild_model(config, data), which
    except (OrchestratorError, WorkloadBug) as err:  # no final model; the factory failed
        raise ConfigError(f"export: {first_line(err)}") from None
    except RuntimeError as err:  # a state that does not fit the workload's model (load_state_dict)
        raise ConfigError(f"export: the state does not fit {config.workload.factory}'s model: {first_line(err)}") from None


def _data_tokenizer(config: JobConfig, err: TextIO) -> Path | None:
    """The tokenizer of the prepared folder the workload's `data_dir` names, if any."""
    data_dir = config.workload.params.get("data_dir")
    if not data_dir:
        return None
    try:
        return read_manifest(Path(str(data_dir)).expanduser()).tokenizer
    except ValueError as error:
        print(f"export: no tokenizer from the workload's data_dir: {error}", file=err, flush=True)
        return None


def _load_tokenizer(transformers: ModuleType, folder: Path) -> Any:
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - whatever a tokenizer's loader raises, said in one line
        text = str(error).splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(f"export: {folder}: cannot be loaded as a tokenizer ({text})") from None


def _name_special_tokens(model: Any, tok: Any, err: TextIO) -> None:
    """The tokenizer's end-of-text (and start) ids as the model's where its configuration has none."""
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        print(f"export: warning: the tokenizer has {len(tok)} tokens, the model's vocabulary {vocab}: ids past it "
              f"cannot be fed to the model", file=err, flush=True)
    for name in ("eos_token_id", "bos_token_id"):
        value = getattr(tok, name, None)
        if value is not None and getattr(model.config, name, None) is None:
            setattr(model.config, name, value)
            setattr(model.generation_config, name, value)
    if model.generation_config.pad_token_id is None and tok.eos_token_id is not None:
        model.generation_config.pad_token_id = tok.eos_token_id


def export_hf(run_dir: str | Path, out: str | Path, checkpoint: str | None = None, tokenizer: str | Path | None = None,
              overwrite: bool = False, err: TextIO | None = None) -> Exported:
    """Write the run's final model (or `checkpoint`: a step, or a checkpoint's data file) as a Hugging
    Face model folder `out`, with the tokenizer when one is known. ConfigError in one line on bad input
    (no such run, checkpoint or tokenizer; a model that is not a `transformers` one; `out` exists).
    Warnings go to `err` (default: sys.stderr)."""
    err = err or sys.stderr
    target = Path(out).expanduser().absolute()
    if target.exists() and not overwrite:
        raise ConfigError(f"export: {target} exists; pass --overwrite to replace it")
    run = Path(run_dir).expanduser()
    config = _config(run)
    transformers = _transformers()
    model, which = _model(run, config, checkpoint)
    if not isinstance(model, transformers.PreTrainedModel):
        raise ConfigError(f"export --hf: the run's model is a {type(model).__module__}.{type(model).__name__}, not a "
                          f"transformers model; export --hf needs a Hugging Face workload "
                          f"(orchestrator.workloads.hf:causal_lm); orchestrator.load_model({str(run)!r}) gives the "
                          f"model of any other as a torch module")
    tok_dir = Path(tokenizer).expanduser() if tokenizer else _data_tokenizer(config, err)
    tok = _load_tokenizer(transformers, tok_dir) if tok_dir else None
    if tok is not None:
        _name_special_tokens(model, tok, err)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        model.save_pretrained(str(staging))
        if tok is not None:
            tok.save_pretrained(str(staging))
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once published
    return Exported(target, which, tok_dir.resolve() if tok_dir else None)
