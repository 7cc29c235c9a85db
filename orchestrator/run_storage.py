"""Where a job's runs are kept, seen from the driver: `<run root>/<job name>` on this node's disk, or the
`storage:` URI (shared by every node), checked before anything starts."""
from __future__ import annotations

from pathlib import Path

import ray

from actors.runs.storage import Storage, StorageError, is_remote, open_storage
from core.schema import ConfigError, JobConfig
from orchestrator.config import default_run_root


def job_root(config: JobConfig) -> Path:
    """`<run root>/<job name>`: every run of this job has a folder below it."""
    return (Path(config.run_dir) if config.run_dir else default_run_root()) / config.name


def job_storage(config: JobConfig) -> Storage:
    """Where the job's runs are kept: `storage` (a URI), else the local run root."""
    if is_remote(config.storage):
        return open_storage(str(config.storage), config.storage_options)
    return open_storage(str(job_root(config).parent))


def check_storage(config: JobConfig) -> Storage:
    """The job's storage, tried (a probe object) before anything starts: ConfigError naming `storage`."""
    try:
        storage = job_storage(config)
        if storage.remote:
            storage.check()
        return storage
    except StorageError as err:
        raise ConfigError(str(err)) from None


def warn_local_storage(config: JobConfig) -> None:
    """A cluster of several nodes with the runs on one node's disk: Ray may restart the coordinator
    or the parameter server on another node, which finds nothing there (unless it is a shared mount)."""
    if is_remote(config.storage):
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        print(f"warning: storage: the runs are kept in a local folder ({job_root(config).parent}) on a cluster of "
              f"{len(nodes)} nodes; other nodes do not see it unless it is a shared mount (set storage: s3://...)",
              flush=True)
