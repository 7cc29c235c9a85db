"""A run's final model, rebuilt where a user wants it, without Ray: `load_model(run_dir)` and
`JobResult.model()`.

`model.pt` holds the final training state (docs/results.md says what each key holds), not a
pickled module: the model is rebuilt as every worker built it (torch seeded with the job's `seed`,
then `workload.factory(**workload.params)`, both from the run's `config.yaml`) and the state's
`model` entry (parameters and buffers) is loaded into it. Nothing is unpickled: the state is read
with `weights_only=True`, onto the CPU.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from core.schema import JobConfig, JobResult, OrchestratorError, parse

if TYPE_CHECKING:  # pragma: no cover
    import torch

MODEL_FILE = "model.pt"


def rebuild_model(config: JobConfig, state_bytes: bytes) -> torch.nn.Module:
    """`config`'s workload model, built as the job built it, with the training state `state_bytes` (the
    bytes of a `model.pt` or of a checkpoint's data file) loaded into it."""
    import torch

    from actors.training.workload import build_workload

    state = torch.load(io.BytesIO(state_bytes), weights_only=True, map_location="cpu")
    model = build_workload(config).model
    model.load_state_dict(state["model"])
    return model


def load_model(run_dir: str | os.PathLike[str]) -> torch.nn.Module:
    """The final model of a run that ended: `run_dir` is its run folder (`<root>/<job>/<run id>`, which
    `run` prints), or the run on its storage (`s3://bucket/prefix/<job>/<run id>`, credentials as for the
    job). The workload's factory must be importable here (the working directory comes first, as for
    the job). OrchestratorError in one line when the run has no final model or no config."""
    from actors.runs.storage import StorageError, is_remote, open_storage  # the package's import stays light

    where = str(run_dir)
    if is_remote(where):
        storage = open_storage(where)

        def read(name: str) -> bytes:
            try:
                return storage.read(name)
            except (FileNotFoundError, StorageError) as err:
                raise OrchestratorError(f"load_model: {storage.location(name)}: {err}") from None
    else:
        folder = Path(where).expanduser()

        def read(name: str) -> bytes:
            try:
                return (folder / name).read_bytes()
            except OSError as err:
                raise OrchestratorError(f"load_model: {folder / name}: {err.strerror or err} (a run folder holds "
                                        f"config.yaml, and {MODEL_FILE} once the run has ended)") from None
    config = parse(JobConfig, yaml.safe_load(read("config.yaml")))
    return rebuild_model(config, read(MODEL_FILE))


class RunResult(JobResult):
    """What `ElasticJob.wait()` returns (exported as `orchestrator.JobResult`): the run's end, and its
    final model (`model()`)."""

    def model(self) -> torch.nn.Module:
        """The final model, rebuilt from the run folder (`load_model(run_dir)`)."""
        return load_model(self.run_dir)
