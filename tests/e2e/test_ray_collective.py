"""A workload's own `ray.util.collective` calls run on its membership epoch's group, across
membership changes: every call sums over exactly the epoch's members, a new epoch is a new group
name, and a member killed mid-run costs the survivors no timeout (their pending call fails, the
step is redone in the next epoch). The abort and timeout of such a call on a silent peer, which no
connection reset releases, are in tests/integration/test_comm.py."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import paced, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_workload_allreduce_through_ray_util_collective_across_a_scale_up_and_a_kill(run_root, tmp_path, monkeypatch):
    """The workload's own calls may wait 120 s (`comm.timeout_s`) and the test waits 60 s for the
    replacement's first call: survivors stuck in a workload's all-reduce when w1 dies are released by
    the epoch's abort, or the test fails on its deadline."""
    monkeypatch.chdir(REPO / "tests" / "workloads")
    logs = tmp_path / "calls"
    logs.mkdir()
    cfg = {"name": "raycol", "seed": 5, "workers": {"count": 2, "max": 3, "cpus": 0.5},
           "workload": {"factory": "collective_workload:make", "params": {"log_dir": str(logs)}, "batch_size": 8},
           "optimizer": {"name": "sgd", "lr": 0.05}, "stop": {"max_steps": 1_000_000}, "eval_every": 0,
           "comm": {"timeout_s": 120.0}}
    job = ElasticJob(config_from_dict(paced(cfg))).start()

    def worlds_logged(slot: str = "") -> set[tuple[str, int]]:
        """(group, world size) of every call logged so far (by `slot` when given)."""
        return {(line.split()[0], int(line.split()[2])) for path in logs.iterdir() if not slot or path.stem == slot
                for line in path.read_text().splitlines() if len(line.split()) == 5}

    job.wait_for(step=16)
    job.scale(3)
    # The published plan says world size 3 before the joiner has run a step: wait for a call of size 3.
    wait_until(lambda: any(world == 3 for _, world in worlds_logged()), what="the scale-up's first call at world size 3")
    victim = next(m for m in job.status().members if m.slot == "w1")
    before_kill = {group for group, _ in worlds_logged()}
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: any(m.slot == "w1" and m.pid != victim.pid and m.rank >= 0 for m in job.status().members)
               and {group for group, _ in worlds_logged("w1")} - before_kill, timeout=60, what="the replacement's first call")
    job.stop()

    history = job.history()
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    calls = [line.split() + [path.stem] for path in logs.iterdir() for line in path.read_text().splitlines()]
    groups: dict[str, set] = {}
    for name, rank, world, ones, ranks, slot in calls:
        rank, world, ones, ranks = int(rank), int(world), int(ones), int(ranks)
        assert 0 <= rank < world and ones == world and ranks == world * (world - 1) // 2, (name, slot, rank, world)
        groups.setdefault(name, set()).add((slot, rank, world))
    sizes = sorted({w for members in groups.values() for _, _, w in members})
    print(f"{len(calls)} ray.util.collective all-reduces in {len(groups)} membership epochs' groups, world sizes {sizes}")
    assert len(groups) >= 3 and {2, 3} <= set(sizes)
    for members in groups.values():  # one name per epoch: one world size, each slot one rank of its own
        slots = {s for s, _, _ in members}
        assert len({w for _, _, w in members}) == 1 and len(members) == len(slots) == len({r for _, r, _ in members}), members
    death = next(e for e in job.events() if e["kind"] == "reshape" and "w1" in e["detail"]["old_members"]
                 and "w1" not in e["detail"]["new_members"])
    first = death["detail"]["first_committed_step"]
    gap = max(b["time"] - a["time"] for a, b in zip(history, history[1:]) if first - 3 <= b["step"] <= first + 1)
    print(f"kill -> survivors' first commit at step {first} ({death['detail']['detector']}); the longest step "
          f"around it took {gap:.2f}s")
