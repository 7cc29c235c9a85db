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
import subprocess
from pathlib import Path

from core.schema import NetworkConfig, OrchestratorError

SHIM_SOURCE = Path(__file__).parent.parent / "native" / "lab_bind.c"  # actors/native/


class LabUnavailable(OrchestratorError):
    """The lab cannot run here (not root, no `tc`, no C compiler, or `lo` has someone else's qdisc)."""


def shim_path(build: bool = False) -> Path:
    """The compiled shim (built when `build` and missing); keyed by its source's hash."""
    source = SHIM_SOURCE.read_bytes()
    out = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orchestrator" / \
        f"lab_bind-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if out.exists() or not build:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
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


def worker_env(net: NetworkConfig) -> dict[str, str]:
    """Environment of a lab worker's process: the shim preloaded, and the lab's subnet (the worker sets
    ORCHESTRATOR_LAB_SOURCE to its node's address once it knows its slot)."""
    path = shim_path()
    if not path.exists():
        raise LabUnavailable(f"the lab's shim {path} is missing: bring the lab up first")
    preload = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{path}:{preload}" if preload else str(path), "ORCHESTRATOR_LAB_NET": net.subnet}


