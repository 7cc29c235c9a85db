"""The run directory: atomic writes, JSON-lines readers, and the job's record in Ray's KV store.

Layout of `<root>/<job name>/<run id>/`: `config.yaml` (resolved), `history.jsonl`,
`events.jsonl`, `status.json` (final), `model.pt` (final), `workers/<slot>.log`,
`checkpoints/`. Everything is written with write-to-temp, fsync, rename, so a crash never
leaves a half-written file under the real name.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

KV_NAMESPACE = "orchestrator"
log = logging.getLogger(__name__)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, default=str) + "\n").encode())


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        log.warning("%s: skipping a line torn by a crash mid-write", path)
    except OSError as err:
        log.debug("%s: %s", path, err.strerror)
    return out


def publish_record(name: str, record: dict) -> None:
    """A small record in Ray's KV store, so `status NAME` answers after the actors are gone."""
    try:
        from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

        if _internal_kv_initialized():
            _internal_kv_put(f"job/{name}", json.dumps(record).encode(), overwrite=True, namespace=KV_NAMESPACE)
    except Exception as err:  # noqa: BLE001 - the run directory still has the record
        log.warning("could not publish job %s's record in Ray's KV store: %s", name, err)


def lookup_record(name: str) -> Optional[dict]:
    try:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        if _internal_kv_initialized():
            raw = _internal_kv_get(f"job/{name}", namespace=KV_NAMESPACE)
            return json.loads(raw) if raw else None
    except Exception as err:  # noqa: BLE001 - no record is the answer
        log.debug("could not read job %s's record from Ray's KV store: %s", name, err)
        return None
    return None
