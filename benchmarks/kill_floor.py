"""How soon anyone can see a SIGKILLed process gone: kill -> its peer's socket reads end-of-file.

A worker's death is seen by the survivors (their collectives fail on the closed connection) and by
Ray (the raylet's socket to the worker closes) only once the kernel has closed the dead process's
descriptors, which it does after tearing down its address space. So the time from the SIGKILL to
the end-of-file on a socket the process held is a floor under every detector of a death here, and
it grows with the memory the process maps. This times it for a child that imports torch (as a
worker does) and holds `--mb` MiB more, against one that holds nothing extra, each with its heap on
4-KiB pages and on transparent huge pages (glibc's `glibc.malloc.hugetlb=1`, what
`workers.huge_pages` gives a worker), alternating.

It also times the child's lifeline (actors/lifeline.py, as a worker holds one): kill -> the watcher's
wake, which the kernel gives as the exit begins, before the teardown. That is how soon the coordinator
learns of a death on its own node; the end-of-file is how soon everyone else does.

    python benchmarks/kill_floor.py [--runs 7] [--mb 0 300]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, REPO)

from actors.control.workers import HUGE_PAGES_TUNABLE  # noqa: E402
from actors.lifeline import watch  # noqa: E402

CHILD = """
import json, socket, sys, time
import torch
from actors.lifeline import Lifeline
held = torch.ones(int(sys.argv[2]) * 2**18)  # MiB of float32
line = Lifeline.hold()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(json.dumps(line.info() if line else {}).encode() + b"\\n")
time.sleep(600)
"""


PAGES = {"4 KiB": None, "huge": HUGE_PAGES_TUNABLE}
"""The child's heap: as the system sets it, or on transparent huge pages (GLIBC_TUNABLES)."""


def kill_to_eof_ms(server: socket.socket, mb: int, tunable: str | None = None) -> tuple[float, float | None]:
    """(kill -> end-of-file, kill -> the lifeline's wake or None where there is none), in ms."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    if tunable:
        env["GLIBC_TUNABLES"] = tunable
    else:
        env.pop("GLIBC_TUNABLES", None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(server.getsockname()[1]), str(mb)], env=env)
    try:
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            hello = b""
            while not hello.endswith(b"\n"):
                part = conn.recv(4096)
                if not part:
                    raise RuntimeError("the child did not report ready")
                hello += part
            woke: list[float] = []
            ended = threading.Event()
            watcher = watch(child.pid, json.loads(hello), lambda: (woke.append(time.perf_counter()), ended.set()),
                            wanted=lambda: not ended.is_set())
            killed = time.perf_counter()
            os.kill(child.pid, signal.SIGKILL)
            if conn.recv(1) != b"":
                raise RuntimeError("expected end-of-file")
            eof = (time.perf_counter() - killed) * 1000
            if watcher is not None:
                ended.wait(60)
            return eof, (woke[0] - killed) * 1000 if woke else None
    finally:
        child.kill()
        child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--mb", type=int, nargs="+", default=[0, 300], help="extra MiB each child holds")
    args = parser.parse_args()
    results: dict[tuple[str, int], list[float]] = {(pages, mb): [] for pages in PAGES for mb in args.mb}
    lifeline: dict[tuple[str, int], list[float]] = {case: [] for case in results}
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        for _ in range(args.runs):
            for pages, mb in results:  # alternating, so that the machine's load falls on every case alike
                eof, woke = kill_to_eof_ms(server, mb, PAGES[pages])
                results[pages, mb].append(eof)
                if woke is not None:
                    lifeline[pages, mb].append(woke)

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]" if values else "n/a"
    print(f"{'child (imports torch) holding':<30}{'pages':>8}{'kill -> EOF ms':>26}{'kill -> lifeline ms':>26}")
    for (pages, mb), values in results.items():
        print(f"{f'+{mb} MiB':<30}{pages:>8}{spread(values):>26}{spread(lifeline[pages, mb]):>26}")
    print(json.dumps({"benchmark": "kill_floor", "runs": args.runs,
                      "kill_to_eof_ms": {f"{pages}/{mb}": v for (pages, mb), v in results.items()},
                      "median_ms": {f"{pages}/{mb}": statistics.median(v) for (pages, mb), v in results.items()},
                      "kill_to_lifeline_ms": {f"{pages}/{mb}": v for (pages, mb), v in lifeline.items()},
                      "lifeline_median_ms": {f"{pages}/{mb}": statistics.median(v) if v else None
                                             for (pages, mb), v in lifeline.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
