"""Where the test suite's CPU goes: every process the suite starts, by kind and by test.

Runs a command (by default the README's test command) while a sampler reads every process's CPU
seconds (user + system, from /proc) twice a second, and a pytest plugin (this module, loaded with
`-p benchmarks.suite_cpu`) logs when each test began and ended in which pytest process. Then it
attributes each process the suite started to a kind (Ray's worker actors by their process title,
`ray::Worker`, `ray::Coordinator`, ...; Ray's own daemons; the pytest processes; `orchestrator` CLI
runs) and to the test file whose test its pytest ancestor was running when it was first seen.

    python benchmarks/suite_cpu.py [--out DIR] [-- pytest args...]

Prints the total CPU seconds, the wall time, the kinds (processes, CPU seconds, per process) and the
test files whose processes used the most; writes procs.jsonl and tests.jsonl to --out. Linux only. A
process that lives less than the sampling interval is missed; one that ends between two samples
loses at most its last half second.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
KINDS = ("gcs_server", "raylet", "log_monitor", "dashboard.py", "monitor.py", "moto", "prometheus")


# ---------------------------------------------------------------------------------- the pytest plugin
_began: dict[str, float] = {}


def pytest_runtest_logstart(nodeid, location):  # pytest's hook signature
    _began[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("SUITE_CPU_TESTS")
    if path and nodeid in _began:
        with open(path, "a") as f:
            f.write(json.dumps({"id": nodeid, "pid": os.getpid(), "t0": _began.pop(nodeid), "t1": time.time()}) + "\n")


# ---------------------------------------------------------------------------------- the sampler
class Sampler:
    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], dict] = {}
        self._first = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return list(self.seen.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.snap()
            self._first = False
            self._stop.wait(0.5)
        self.snap()

    def snap(self) -> None:
        now = time.time()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rfind(")") + 2:].split()
                cpu = (int(fields[11]) + int(fields[12])) / TICK
                key = (int(name), int(fields[19]))  # pid and start time: a reused pid is a new process
                entry = self.seen.get(key)
                if entry is None:
                    entry = self.seen[key] = {"pid": int(name), "ppid": int(fields[1]), "first": now, "cmd": "",
                                              "before": cpu if self._first else 0.0}  # what it used before the run
                if cpu - entry["before"] != entry.get("cpu"):  # a process's title changes (ray::IDLE becomes ray::Worker)
                    with open(f"/proc/{name}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    entry["cmd"] = cmd or entry["cmd"]
                entry["cpu"], entry["last"] = cpu - entry["before"], now
            except (OSError, IndexError, ValueError):
                continue


def kind(cmd: str) -> str:
    title = re.match(r"ray::(\w+)", cmd)
    if title:
        return "ray::" + title.group(1)
    for name in KINDS:
        if name in cmd:
            return name
    if "-m orchestrator" in cmd:
        return "orchestrator " + cmd.split("-m orchestrator", 1)[1].split()[0]
    if "exec(eval(sys.stdin.readline()))" in cmd or " -m pytest" in cmd:
        return "pytest process (unit tests run here)"
    return "other"


def report(procs: list[dict], tests: list[dict], wall: float, top: int = 25) -> str:
    total = sum(p["cpu"] for p in procs)
    lines = [f"wall {wall:.0f} s; CPU {total:.0f} s ({total / max(wall, 1e-9):.2f} cores busy on average)"]
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for p in procs:
        by_kind[kind(p["cmd"])][0] += 1
        by_kind[kind(p["cmd"])][1] += p["cpu"]
    lines.append(f"{'CPU s':>8} {'procs':>6} {'s/proc':>7}  kind")
    for name, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{cpu:8.1f} {n:6d} {cpu / n:7.2f}  {name}")
    # each process to the test its pytest ancestor was running when the process was first seen
    windows: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for t in tests:
        windows[t["pid"]].append((t["t0"], t["t1"], t["id"]))
    parents = {p["pid"]: p["ppid"] for p in procs}
    per_test: dict[str, float] = collections.defaultdict(float)
    for p in procs:
        pid, hops = p["ppid"], 0
        while pid not in windows and pid in parents and hops < 30:
            pid, hops = parents[pid], hops + 1
        if pid in windows and p["pid"] not in windows:
            test = next((w[2] for w in windows[pid] if w[0] <= p["first"] <= w[1] + 0.5), "(between tests)")
            per_test[test] += p["cpu"]
    by_file: dict[str, float] = collections.defaultdict(float)
    for test, cpu in per_test.items():
        by_file[test.split("::")[0]] += cpu
    lines.append("\nCPU of the processes each test file started (Ray's session daemons count to the first test):")
    lines += [f"{cpu:8.1f}  {name}" for name, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="suite-cpu", help="folder for procs.jsonl and tests.jsonl")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests_path = out / "tests.jsonl"
    tests_path.unlink(missing_ok=True)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, SUITE_CPU_TESTS=str(tests_path.resolve()),
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    sampler = Sampler().start()
    began = time.time()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.suite_cpu", *args.pytest_args],
                           cwd=repo, env=env)
    wall = time.time() - began
    procs = sampler.stop()
    with open(out / "procs.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in procs)
    tests = [json.loads(line) for line in tests_path.read_text().splitlines()] if tests_path.exists() else []
    print(report(procs, tests, wall))
    print(json.dumps({"bench": "suite_cpu", "wall_s": round(wall, 1), "cpu_s": round(sum(p["cpu"] for p in procs), 1),
                      "pytest_exit": code}))
    return code


if __name__ == "__main__":
    sys.exit(main())
