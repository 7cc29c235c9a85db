"""Processes and ports a test starts: a `python -m orchestrator` child's environment, a free port for a
server, a `run` started (again, when Ray's own start timed out) and SIGKILLed at a given step, and
whether a process still runs or has torch loaded."""
from __future__ import annotations

import os
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def child_env(repo, **over: str) -> dict:
    """The environment for a `python -m orchestrator ...` child process: the repository first on
    PYTHONPATH, ahead of what is already there (where Ray may live, as on the GPU machine)."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo)] + ([path] if path else [])), **over)


QUIET_PORTS_FROM = 20000
"""`free_port` draws from here up to the kernel's ephemeral range: above Ray's worker ports (10002 to
19999 by default), and below the range every bind(0) and outgoing connection takes its port from."""


def free_port() -> int:
    """A TCP port free on this machine now, for a server a test starts. Drawn at random below the
    kernel's ephemeral range, where nothing takes a port unasked: a port from that range (bind(0)) was
    free when drawn but could be taken before a slow server bound it, by any connection of the tests
    beside it (a head node's agents bind theirs tens of seconds after `ray start`, and when one cannot,
    `ray start --block` takes the whole head down)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    draw = random.SystemRandom()  # not the tests' seeded `random`: each process draws its own
    for _ in range(1000):
        port = draw.randrange(QUIET_PORTS_FROM, max(ephemeral, QUIET_PORTS_FROM + 1))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {QUIET_PORTS_FROM}..{ephemeral - 1}")


RAY_START_TIMED_OUT = "The current node timed out during startup"
"""What `ray.init` raises when its raylet did not register within the 30 s Ray allows (ray/_private/node.py)."""


def start_run(args: list[str], cwd: Path, env: dict, output: Path, tries: int = 2) -> Any:
    """`python -m orchestrator run ARGS` in a session of its own (it starts its own local Ray), its
    output appended to `output`; returned once it printed its job line (Ray is up) or ended. Ray's own
    start can time out on a loaded machine (two clean-clone CI runs saw a run exit 1 with
    RAY_START_TIMED_OUT before its first step): such a run's process group is killed and it starts
    again, at most `tries` times in all."""
    import subprocess
    import sys

    for attempt in range(tries):
        offset = output.stat().st_size if output.exists() else 0
        with open(output, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", *args], cwd=cwd, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def said() -> str:
            with open(output, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and \
                not any(line.startswith("job ") for line in said().splitlines()):
            time.sleep(0.05)
        if proc.poll() is None or RAY_START_TIMED_OUT not in said() or attempt == tries - 1:
            return proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the failed start left running
        except OSError:
            pass
    return proc


def sigkill_run_at(proc: Any, newest_step: Callable[[], int], at: int, timeout: float = 120,
                   output: Path | None = None) -> None:
    """SIGKILL the process group of `proc` (a `run` started with `start_new_session=True`) once
    `newest_step()` reaches `at`, and wait until every process of it is gone (Ray's own exit once
    their parent has). `output`: the file the run writes its output to, whose end a failure shows."""
    import psutil

    def said() -> str:
        text = output.read_text(errors="replace") if output is not None and output.exists() else ""
        return f"; its output ends:\n{text[-3000:]}" if text else ""

    group = [proc.pid]
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"run ended (exit {proc.returncode}) before step {at}{said()}"
            assert time.monotonic() < deadline, f"run did not reach step {at} within {timeout:g}s{said()}"
            if newest_step() >= at:
                break
            time.sleep(0.02)
        group = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)] + [proc.pid]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while [p for p in group if running(p)]:
        assert time.monotonic() < deadline, "processes of the killed run left behind"
        time.sleep(0.2)


def loaded_torch(pid: int) -> bool:
    """Whether process `pid` (on this machine) has torch's library mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie. A process can end between any two looks at it
    (a clean-clone CI run saw one pass `pid_exists` and be gone when its status was read)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False




def run_group_processes(member: Callable[..., None], world: int, args: tuple, timeout_s: float = 1800.0) -> list[dict]:
    """`world` spawned processes, `member(rank, port, *args, out)` each, that form gloo groups over one
    TCPStore served here (bound to the loopback address) and each put one dict with its "rank" on `out`;
    the dicts in rank order (a benchmark's members: benchmarks/join_memory.py, sharded_memory.py)."""
    import multiprocessing as mp

    from actors.transport.store import serve_store

    store, port, sock = serve_store("127.0.0.1", 600.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=member, args=(rank, port, *args, out)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((out.get(timeout=timeout_s) for _ in procs), key=lambda row: row["rank"])
    finally:
        for p in procs:
            p.join(60)
        sock.close()
        del store
