"""The worker-process side of the network lab (orchestrator/lab.py): the `connect()` shim a lab worker
preloads, and the environment that preloads it.

gloo connects its sockets without binding them, so every loopback connection would leave from
127.0.0.1 and the lab's shaping rules (which match source and destination node addresses) could not
tell two virtual nodes apart. `native/lab_bind.c` binds a connection into the lab's subnet to the
worker's own node address first; it is compiled once per source version into the user's cache when
the lab comes up, and the coordinator starts lab workers with it in `LD_PRELOAD`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

from core.schema import NetworkConfig, OrchestratorError

SHIM_SOURCE = Path(__file__).parent.parent / "native" / "lab_bind.c"  # actors/native/


class LabUnavailable(OrchestratorError):
    """The lab cannot run here (not root, no `tc`, no C compiler, or `lo` has someone else's qdisc)."""


def shim_path(build: bool = False) -> Path:
    """The compiled shim (built when `build` and missing); keyed by its source's hash. Every worker of a
    lab job preloads it, so one found at this predictable path is used only when this user alone can
    have written it (`untrusted`); otherwise the lab refuses in one line."""
    source = SHIM_SOURCE.read_bytes()
    out = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orchestrator" / \
        f"lab_bind-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if os.path.lexists(out) or not build:
        if os.path.lexists(out) and (why := untrusted(out)):
            raise LabUnavailable(f"the lab's shim {out} is not used: {why}; remove it (or set XDG_CACHE_HOME to a "
                                 f"folder of yours) and bring the lab up again")
        return out
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if why := untrusted(out.parent):
        raise LabUnavailable(f"the lab's shim cannot be built in {out.parent}: {why}; set XDG_CACHE_HOME to a folder of yours")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise LabUnavailable("compiling the lab's connect() shim needs a C compiler: install cc or gcc")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SHIM_SOURCE), "-ldl"],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise LabUnavailable(f"compiling the lab's connect() shim failed: {result.stderr.strip()[:300]}")
    os.replace(tmp, out)
    return out


def untrusted(path: Path) -> str | None:
    """Why `path` (the shim or its folder) may have been written by someone other than this user: a link,
    another owner, or write access for the group or others, on it or on its folder; None when none."""
    for item in (path, path.parent) if path.suffix == ".so" else (path,):
        info = os.lstat(item)
        if stat.S_ISLNK(info.st_mode):
            return f"{item} is a symbolic link"
        if info.st_uid != os.geteuid():
            return f"{item} belongs to uid {info.st_uid}, not this user ({os.geteuid()})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{item} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def worker_env(net: NetworkConfig) -> dict[str, str]:
    """Environment of a lab worker's process: the shim preloaded, and the lab's subnet (the worker sets
    ORCHESTRATOR_LAB_SOURCE to its node's address once it knows its slot)."""
    path = shim_path()
    if not path.exists():
        raise LabUnavailable(f"the lab's shim {path} is missing: bring the lab up first")
    preload = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{path}:{preload}" if preload else str(path), "ORCHESTRATOR_LAB_NET": net.subnet}


