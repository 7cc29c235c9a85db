"""Measuring the user's cluster (actors/training/probe.py): probes placed as the job's workers would be, on the
session's Ray (one node here), time the workload's compute on each placed probe and the node's own rate
over gloo; `plan --probe` without a lab prints what it measured, and on one node recommends an exact
policy; on two Ray nodes on the lab's addresses, shaped to 100 Mbit/s between them, it reports the
shaped rate."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from actors.training.probe import fit, probe_cluster
from core.schema import NetworkConfig, parse
from orchestrator import planner
from orchestrator.config import config_from_dict
from testkit.harness import child_env

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"name": "probe", "seed": 1, "workers": {"count": 2, "cpus": 0.5},
          "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "batch_size": 16},
          "stop": {"max_steps": 100, "target": {"metric": "accuracy", "value": 0.95}}}


def test_the_fit_of_a_two_rank_all_reduce_gives_rate_and_latency():
    """t(P) = P/B + 2L, written out: 100 Mbit/s (12.5e6 B/s) and 1 ms one way."""
    rate, latency = 12.5e6, 0.001
    points = [(size, size / rate + 2 * latency) for size in (4096, 1 << 20, 4 << 20)]
    got_rate, got_latency = fit(points)
    assert abs(got_rate - rate) / rate < 1e-9 and abs(got_latency - latency) < 1e-9


def test_probes_measure_compute_on_placed_workers_and_the_nodes_own_rate(ray_session):
    cfg = config_from_dict(CONFIG)
    cluster = probe_cluster(cfg.to_dict())
    print({k: v for k, v in cluster.items() if k != "compute"})
    assert cluster["node_of_rank"] == [0, 0] and len(cluster["nodes"]) == 1
    assert len(cluster["compute"]) == 2 and all(len(t) == 12 and min(t) > 0 for t in cluster["compute"])
    assert cluster["threads"] == 1 and cluster["device"] == "cpu"  # the job's workers.cpus, on its device
    assert cluster["model_bytes"] == sum(4 * n for n in (64 * 64, 64, 64 * 64, 64, 64 * 10, 10))
    [own] = cluster["links"]
    assert own["a"] == own["b"] == 0 and own["bytes_per_s"] > 10e6 and own["points"][-1][0] >= 1 << 20
    chosen, line, rows = planner.choose(config_from_dict({**CONFIG, "sync": {"policy": "auto"}}), cluster=cluster)
    assert rows[0].exact and chosen.sync.policy == "bsp", line
    assert "measured on the cluster: 1 node(s)" in line and "the network as measured" in line


def test_plan_probe_without_a_lab_measures_the_cluster(ray_session, tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(CONFIG))
    env = child_env(REPO, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    out = subprocess.run([sys.executable, "-m", "orchestrator", "plan", str(path), "--probe", "--json"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result["recommendation"], result["cluster"])
    assert result["cluster"]["node_of_rank"] == [0, 0] and len(result["cluster"]["compute_median_s"]) == 2
    assert result["rows"][0]["exact"] and result["recommendation"].startswith("bsp")


def _lab_reason() -> str:
    from orchestrator import lab

    try:
        lab.check_privileges()
        return ""
    except lab.LabUnavailable as err:
        return str(err)


@pytest.mark.exclusive  # it shapes the loopback's root qdisc, which every test's traffic crosses
def test_plan_probe_on_two_nodes_shaped_to_100_mbit_measures_the_link_and_a_workers_compute(tmp_path):
    """Two Ray nodes (testkit/lab_cluster.py) on lab addresses, the link between them shaped to
    100 Mbit/s (12.5e6 bytes/s each way): `plan --probe` places one probe on each node, reports the
    inter-node rate within 15% of the shaping and each rank's compute as measured on it."""
    reason = _lab_reason()
    if reason:
        pytest.skip(f"the lab cannot run here: {reason}")
    from orchestrator import lab
    from testkit.lab_cluster import lab_cluster

    net = parse(NetworkConfig, {"nodes": 2, "workers_per_node": 1, "subnet": "127.78.0.0/24",
                                "inter": {"mbit": 100, "latency_ms": 0.0}}, "network")
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**CONFIG, "workers": {"count": 2, "cpus": 1, "placement": "spread"}}))
    with lab.Lab(net), lab_cluster(net, cpus_per_node=1) as address:
        out = subprocess.run([sys.executable, "-m", "orchestrator", "plan", str(path), "--probe", "--json"], cwd=REPO,
                             env=child_env(REPO, RAY_ADDRESS=address), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    cluster = result["cluster"]
    print(result["recommendation"], {k: v for k, v in cluster.items() if k not in ("compute", "backward")})
    assert sorted(cluster["nodes"]) == [net.address(0), net.address(1)] and sorted(cluster["node_of_rank"]) == [0, 1]
    [link] = cluster["links"]
    assert link["a"] != link["b"] and abs(link["bytes_per_s"] - 12.5e6) / 12.5e6 < 0.15, link
    assert len(cluster["compute_median_s"]) == 2 and all(t > 0 for t in cluster["compute_median_s"])
    assert cluster["threads"] == 1 and cluster["device"] == "cpu"
