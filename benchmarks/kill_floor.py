"""How soon anyone can see a SIGKILLed process gone: kill -> its peer's socket reads end-of-file.

A worker's death is seen by the survivors (their collectives fail on the closed connection) and by
Ray (the raylet's socket to the worker closes) only once the kernel has closed the dead process's
descriptors, which it does after tearing down its address space. So the time from the SIGKILL to
the end-of-file on a socket the process held is a floor under every detector of a death here, and
it grows with the memory the process maps. This times it for a child that imports torch (as a
worker does) and holds `--mb` MiB more, against one that holds nothing extra, each with its heap on
4-KiB pages and on transparent huge pages (glibc's `glibc.malloc.hugetlb=1`, what
`workers.huge_pages` gives a worker), alternating.

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
import time

from actors.control.workers import HUGE_PAGES_TUNABLE

CHILD = """
import socket, sys, time
import torch
held = torch.ones(int(sys.argv[2]) * 2**18)  # MiB of float32
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"r")
time.sleep(600)
"""


PAGES = {"4 KiB": None, "huge": HUGE_PAGES_TUNABLE}
"""The child's heap: as the system sets it, or on transparent huge pages (GLIBC_TUNABLES)."""


def kill_to_eof_ms(server: socket.socket, mb: int, tunable: str | None = None) -> float:
    env = dict(os.environ)
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
            if conn.recv(1) != b"r":
                raise RuntimeError("the child did not report ready")
            killed = time.perf_counter()
            os.kill(child.pid, signal.SIGKILL)
            if conn.recv(1) != b"":
                raise RuntimeError("expected end-of-file")
            return (time.perf_counter() - killed) * 1000
    finally:
        child.kill()
        child.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--mb", type=int, nargs="+", default=[0, 300], help="extra MiB each child holds")
    args = parser.parse_args()
    results: dict[tuple[str, int], list[float]] = {(pages, mb): [] for pages in PAGES for mb in args.mb}
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        for _ in range(args.runs):
            for pages, mb in results:  # alternating, so that the machine's load falls on every case alike
                results[pages, mb].append(kill_to_eof_ms(server, mb, PAGES[pages]))
    print(f"{'child (imports torch) holding':<30}{'pages':>8}{'kill -> EOF ms, median [min-max]':>36}")
    for (pages, mb), values in results.items():
        print(f"{f'+{mb} MiB':<30}{pages:>8}"
              f"{f'{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]':>36}")
    print(json.dumps({"benchmark": "kill_floor", "runs": args.runs,
                      "kill_to_eof_ms": {f"{pages}/{mb}": v for (pages, mb), v in results.items()},
                      "median_ms": {f"{pages}/{mb}": statistics.median(v) for (pages, mb), v in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
