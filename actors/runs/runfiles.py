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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

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
    write_bytes_atomic(path, json_bytes(obj))


def json_bytes(obj: Any, compact: bool = False) -> bytes:
    """`compact`: no indentation, which lets json use its C encoder (about 10x faster: the coordinator's
    state file at a thousand members)."""
    return (json.dumps(obj, separators=(",", ":"), default=str) if compact else
            json.dumps(obj, indent=1, default=str)).encode() + b"\n"


class BackgroundWriter:
    """Keeps one file equal to the newest of a stream of snapshots, written atomically (temp, fsync,
    rename, fsync of the folder) by a thread of its own, so that the caller (an event loop) never
    waits for the disk. fsync's latency is not bounded: measured here, 1 ms on a quiet disk and
    117 ms right after a checkpoint was written. Snapshots that arrive while one is being written
    are coalesced: only the newest is written next. `submit` returns the snapshot's number (it never
    raises a failed write: its caller may be in the middle of something else); `error` is the last
    write's failure (None once one lands), and `wait(n)` blocks until snapshot n (or a newer one) is
    on disk, False when its write failed."""

    def __init__(self, path: Path, written: Callable[[], None] | None = None) -> None:
        self.path = Path(path)
        self.written = written
        """Called by the writer's thread after each snapshot lands (a remote copy follows it)."""
        self._cond = threading.Condition()
        self._pending: bytes | None = None
        self._submitted = 0
        self._written = 0
        self._attempted = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"writer of {self.path.name}")
        self._thread.start()

    def submit(self, data: bytes) -> int:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.path}: the writer is closed")
            self._submitted += 1
            self._pending = data
            self._cond.notify_all()
            return self._submitted

    @property
    def error(self) -> BaseException | None:
        """Why the newest write attempted failed (None when it landed, or none was attempted)."""
        with self._cond:
            return self._error

    def wait(self, number: int | None = None, timeout: float | None = None) -> bool:
        """True once snapshot `number` (default: the newest submitted) or a newer one is on disk; False
        after `timeout`, or as soon as the write of that snapshot (or a newer one) failed."""
        with self._cond:
            target = self._submitted if number is None else number
            self._cond.wait_for(lambda: self._written >= target or (self._error is not None and self._attempted >= target)
                                or (self._closed and self._pending is None), timeout)
            return self._written >= target

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed, and everything submitted is written
                data, number, self._pending = self._pending, self._submitted, None
            try:
                write_bytes_atomic(self.path, data)
                error = None
            except Exception as err:  # noqa: BLE001 - reported by `error` and `wait()`; the next submit retries
                log.error("could not write %s: %s", self.path, err)
                error = err
            if error is None and self.written is not None:
                self.written()  # before `wait` returns: a waiter's next step may rely on it (the upload queued)
            with self._cond:
                self._error, self._attempted = error, number
                if error is None:
                    self._written = number
                self._cond.notify_all()


def open_appended(path: Path | str) -> TextIO:
    """An appended JSON-lines file, opened to append: a torn last line (a crash, or a copy taken
    mid-write, ended it without its newline) is cut off first, so the next record starts a line of its
    own instead of being glued onto the fragment and lost with it."""
    path = Path(path)
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(max(0, size - 1))
                if f.read(1) != b"\n":
                    keep = _last_newline_end(f, size)
                    log.warning("%s: cutting a torn last line (%d bytes) before appending", path, size - keep)
                    f.truncate(keep)
                    f.flush()
                    os.fsync(f.fileno())
    except FileNotFoundError:
        pass
    return open(path, "a", encoding="utf-8")


def _last_newline_end(f: BinaryIO, size: int, chunk: int = 1 << 16) -> int:
    """The offset just past the file's last newline (0 when it has none), read backwards by chunks."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        at = f.read(end - start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def parse_jsonl(data: bytes, where: str = "") -> list[dict]:
    """JSON lines from bytes (a file, or a mirrored file's parts); a torn line is skipped with a warning."""
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                log.warning("%s: skipping a line torn by a crash mid-write", where or "JSON lines")
    return out


def read_jsonl(path: Path) -> list[dict]:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        log.debug("%s: %s", path, err.strerror)
        return []
    return parse_jsonl(data, str(path))


def publish_record(name: str, record: dict) -> None:
    """A small record in Ray's KV store, so `status NAME` answers after the actors are gone."""
    try:
        from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

        if _internal_kv_initialized():
            _internal_kv_put(f"job/{name}", json.dumps(record).encode(), overwrite=True, namespace=KV_NAMESPACE)
    except Exception as err:  # noqa: BLE001 - the run directory still has the record
        log.warning("could not publish job %s's record in Ray's KV store: %s", name, err)


def lookup_record(name: str) -> dict | None:
    try:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

        if _internal_kv_initialized():
            raw = _internal_kv_get(f"job/{name}", namespace=KV_NAMESPACE)
            return json.loads(raw) if raw else None
    except Exception as err:  # noqa: BLE001 - no record is the answer
        log.debug("could not read job %s's record from Ray's KV store: %s", name, err)
        return None
    return None


def keep_secret(key: str, value: bytes) -> None:
    """A secret in Ray's KV store (only a client with the cluster's token reads it; nothing mirrors it),
    under `secret/<key>`: the rendezvous key of a run, its storage credentials."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(f"secret/{key}", value.hex().encode(), overwrite=True, namespace=KV_NAMESPACE)


def recall_secret(key: str) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(f"secret/{key}", namespace=KV_NAMESPACE)
    return bytes.fromhex(raw.decode()) if raw else None


def forget_secrets(prefix: str) -> None:
    """Delete every secret whose key starts with `prefix` (a run's, `<job>/<run id>/`, once it ended)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(f"secret/{prefix}", del_by_prefix=True, namespace=KV_NAMESPACE)
