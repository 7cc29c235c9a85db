"""What identifies this run of the job to the coordinator's parts: fixed once the coordinator is built.

The config, the run's id and folder, the coordinator's incarnation, the rendezvous key and where the
driver's modules come from; from them, each worker's spec and the small record of the job's end that
Ray's key-value store keeps (`status NAME` answers from it once every actor is gone).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.plan import WorkerSpec
from core.schema import JobConfig


@dataclass(frozen=True, eq=False)
class RunIdentity:
    cfg: JobConfig
    config: dict[str, Any]
    """The job's config as the driver resolved it (what each worker is built from)."""
    run_id: str
    run_dir: Path
    incarnation: int
    """This coordinator's incarnation (a restarted one carries on above every one before it)."""
    search_path: tuple[str, ...] = ()
    secret: bytes = b""
    """The job's rendezvous key: its workers sign what they write to the group store (actors/transport/comm.py)."""
    owner_job: str | None = None
    """The Ray job of the process that owns this job (`python -m orchestrator run`): gone, the job stops."""
    resume_from: str | None = None
    """`--resume`: the checkpoint the first member starts from."""

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def prefix(self) -> str:
        """`<job>/<run id>`: the start of each worker's actor name."""
        return f"{self.name}/{self.run_id}"

    def spec(self, slot: str, incarnation: int) -> WorkerSpec:
        """The spec of `slot`'s worker number `incarnation` (0: a spare's, which a slot adopts)."""
        return WorkerSpec(self.name, self.run_id, slot, str(self.run_dir), self.name, self.cfg.ray.namespace,
                          self.config, self.search_path, incarnation=incarnation, secret=self.secret)

    def end_record(self, state: str) -> dict[str, Any]:
        """What Ray's key-value store keeps of the job once it ended in `state`."""
        return {"run_id": self.run_id, "run_dir": str(self.run_dir), "state": state, "storage": self.cfg.storage,
                "storage_options": dict(self.cfg.storage_options)}
