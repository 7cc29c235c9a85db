"""`workers.huge_pages` on the shared local Ray: a worker's process starts with glibc's huge-page tunable
in its environment and its heap is backed by transparent huge pages (so that its death closes its
sockets sooner: benchmarks/kill_floor.py, docs/benchmarks.md); switched off, neither. Linux only, and
only where THP may be used (`/sys/kernel/mm/transparent_hugepage/enabled` is not `[never]`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import wait_until

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MODE = next((w.strip("[]") for w in THP.read_text().split() if w.startswith("[")), "never") if THP.exists() else "never"
pytestmark = pytest.mark.skipif(MODE == "never" or not Path("/proc/self/smaps_rollup").exists(),
                                reason=f"transparent huge pages unavailable here (mode {MODE})")


def worker_memory(huge_pages: bool) -> list[tuple[bool, int]]:
    """Each worker's (tunable in its environment, AnonHugePages kB) once the job has trained a while."""
    cfg = {"name": f"huge-pages-{str(huge_pages).lower()}", "seed": 0,
           "workers": {"count": 2, "cpus": 0.5, "huge_pages": huge_pages},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"name": "sgd", "lr": 0.05}, "sync": {"policy": "bsp"}, "stop": {"max_steps": 1_000_000},
           "eval_every": 0}
    job = ElasticJob(config_from_dict(cfg)).start()
    try:
        wait_until(lambda: job.status().step >= 30, 120, "30 steps")
        seen = []
        for member in job.status().members:
            environ = Path(f"/proc/{member.pid}/environ").read_bytes().split(b"\0")
            rollup = Path(f"/proc/{member.pid}/smaps_rollup").read_text()
            huge_kb = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages:"))
            seen.append((any(v.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.hugetlb=1" in v for v in environ),
                         huge_kb))
        return seen
    finally:
        job.stop()
        job.wait(timeout=60)


def test_workers_heaps_are_on_huge_pages_unless_switched_off(run_root):
    on = worker_memory(True)
    assert all(tunable for tunable, _ in on), on
    assert all(huge_kb >= 2048 for _, huge_kb in on), f"no huge pages in a worker's heap: {on}"
    off = worker_memory(False)
    assert not any(tunable for tunable, _ in off), off
    if MODE == "madvise":  # under "always" the kernel may back any heap with them
        assert all(huge_kb == 0 for _, huge_kb in off), f"huge pages without the tunable: {off}"
