"""Local runs reachable by name: a job that started its own local Ray records where that Ray is, so that
`status`, `scale`, `stop` and `report` in another shell find the job by its name alone, and, once it has
ended, where its run folder is.

One record per job name, `<name>.json` in a folder of this user's (`~/.orchestrator/local-runs`, or
`ORCHESTRATOR_LOCAL_RUNS`): the folder 0700 and owned by this user (refused otherwise), each record
0600, written to a temp file and renamed, and opened without following links. A record holds the Ray's
GCS address, the pid (and the start time) of the process that owns that Ray, and the run folder; never a
credential (Ray's token stays in Ray's own token file). A local Ray lives exactly as long as the process
that started it, so a record's address counts only while that process lives: when it ends (`ended`, at
its exit) or is found gone (`lookup`), the address is dropped and only the run folder is kept.

No Ray here: the CLI's `report` reads these without starting anything.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import default_run_root

log = logging.getLogger(__name__)
MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class LocalRun:
    """Where a job that started its own local Ray is reached, and where its run folder is."""

    name: str
    run_dir: str
    address: str | None = None
    """The local Ray's GCS address; None once the process that owns it has ended."""
    pid: int = 0
    """The process that started (and owns) the local Ray."""
    pid_started: str = ""
    """That process's start time as the OS counts it, so that a reused pid is not taken for it."""
    started_at: float = 0.0

    @property
    def live(self) -> bool:
        return self.address is not None and self.pid > 0 and process_start(self.pid) == self.pid_started


class UnsafeRecords(OSError):
    """The records folder is a link, or is not this user's alone."""


def records_dir() -> Path:
    return Path(os.environ.get("ORCHESTRATOR_LOCAL_RUNS") or Path.home() / ".orchestrator" / "local-runs").expanduser()


def process_start(pid: int) -> str:
    """The start time of process `pid` (Linux: its start in clock ticks since boot, field 22 of
    /proc/PID/stat); "" when there is no such process. Elsewhere only whether it exists ("?")."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text.rsplit(")", 1)[1].split()[19]  # fields after the command's name, which may hold spaces
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return ""
    except (OSError, IndexError):
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return "?"


def record(run: LocalRun) -> None:
    """Write (or replace) the record of `run.name`. Never raises: a run whose record cannot be written
    trains on, and is reached with --address (its address is printed at its start)."""
    try:
        _write(run)
    except OSError as err:
        log.warning("could not record job %s's local Ray in %s (reach it with --address %s): %s",
                    run.name, records_dir(), run.address, err)


def ended(name: str, pid: int) -> None:
    """The process `pid` is ending, and its local Ray with it: drop the address of its record of `name`
    (a record another process has written since is left alone)."""
    try:
        run = _read(name)
        if run is not None and run.pid == pid and run.address is not None:
            _write(dataclasses.replace(run, address=None))
    except OSError as err:
        log.debug("could not mark job %s's record ended: %s", name, err)


def lookup(name: str) -> LocalRun | None:
    """The record of job `name`, its address dropped (and the record rewritten so) when the process that
    owned that Ray is gone. None when there is none, or it cannot be read safely."""
    try:
        run = _read(name)
        if run is not None and run.address is not None and not run.live:
            run = dataclasses.replace(run, address=None)
            _write(run)
        return run
    except OSError as err:
        log.warning("could not read job %s's record in %s: %s", name, records_dir(), err)
        return None


def run_folder(name: str) -> Path | None:
    """The newest run folder of job `name` on this machine: the recorded one, or the newest under the
    run root (`<root>/<name>/<run id>`), whichever is newer (run ids sort by their start time)."""
    candidates = []
    run = lookup(name)
    if run is not None and Path(run.run_dir).is_dir():
        candidates.append(Path(run.run_dir))
    if _safe_name(name):
        root = default_run_root() / name
        if root.is_dir():
            candidates += [p for p in root.iterdir() if (p / "config.yaml").is_file()]
    return max(candidates, key=lambda p: p.name, default=None)


def _safe_name(name: str) -> bool:
    """A job name that is one plain file name (the config allows letters, digits, '_', '.', '-');
    anything else a command line passes has no record."""
    return bool(name) and len(name) <= 64 and name[0].isalnum() and name == Path(name).name


def _open_dir(create: bool) -> int | None:
    """The records folder, opened without following a link, and checked to be this user's alone."""
    path = records_dir()
    if create:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP, ENOTDIR: a link or a file where the folder should be
        raise UnsafeRecords(f"{path}: not a folder of its own ({err.strerror})") from None
    info = os.fstat(fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise UnsafeRecords(f"{path}: must be this user's and closed to others (mode 0700); it is "
                            f"uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}")
    return fd


def _write(run: LocalRun) -> None:
    if not _safe_name(run.name):
        raise OSError(f"{run.name!r} is not a plain file name")
    folder = _open_dir(create=True)
    assert folder is not None  # created above
    tmp = f".{run.name}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(dataclasses.asdict(run)).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, f"{run.name}.json", src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            os.unlink(tmp, dir_fd=folder)
            raise
    finally:
        os.close(folder)


def _read(name: str) -> LocalRun | None:
    if not _safe_name(name):
        return None
    folder = _open_dir(create=False)
    if folder is None:
        return None
    try:
        fd = os.open(f"{name}.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
    except FileNotFoundError:
        return None
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise UnsafeRecords(f"{name}.json: not a plain file of this user's")
        data = f.read(MAX_RECORD_BYTES)
    try:
        raw = json.loads(data)
        return LocalRun(name=name, run_dir=str(raw["run_dir"]),
                        address=str(raw["address"]) if raw.get("address") else None, pid=int(raw.get("pid", 0)),
                        pid_started=str(raw.get("pid_started", "")), started_at=float(raw.get("started_at", 0.0)))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        log.warning("job %s's record in %s is not readable (%s); ignored", name, records_dir(), err)
        return None
