"""A job on a three-node Ray cluster (ray.cluster_utils.Cluster: the head with the CPUs, two nodes
that may hold the coordinator) with its runs on S3; the coordinator's node is removed mid-run and
its local run folder deleted with it (one machine's nodes share a disk; a lost node's does not
survive). Run by tests/e2e/test_storage.py in a process of its own (it starts its own Ray):

    python tests/e2e/s3_cluster_job.py STORAGE_URI RUN_ROOT OUT_JSON

writes what happened to OUT_JSON: the nodes the coordinator ran on, the time from the node's removal
until the restarted coordinator runs again, the final state and the history's steps."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import ray
from ray.cluster_utils import Cluster

uri, root, out = sys.argv[1:4]
os.environ["ORCHESTRATOR_RUN_ROOT"] = root
os.environ.pop("RAY_ADDRESS", None)
STEPS = 400

from orchestrator.config import config_from_dict  # noqa: E402
from orchestrator.job import ElasticJob  # noqa: E402


def node_of(job: ElasticJob) -> str:
    """The node the coordinator actor runs on (GCS's actor table)."""
    from ray._private.state import state

    return state.actor_table(job._coordinator._actor_id.hex())["Address"]["NodeID"]


cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
nodes = {n: cluster.add_node(num_cpus=0, resources={"coordinator": 1}) for n in ("a", "b")}
cluster.wait_for_nodes()
cfg = {"name": "s3-cluster", "seed": 3, "workers": {"count": 3, "cpus": 1},
       "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
       "optimizer": {"name": "sgd", "lr": 0.05}, "stop": {"max_steps": STEPS}, "eval_every": 0, "storage": uri,
       "ray": {"address": cluster.address, "coordinator_resources": {"coordinator": 0.01}},
       "faults": {"stragglers": [{"slot": f"w{i}", "delay_s": 0.04} for i in range(3)]}}
job = ElasticJob(config_from_dict(cfg)).start()
report: dict = {"steps": STEPS}
try:
    deadline = time.monotonic() + 120
    while job.status().step < 50:
        assert time.monotonic() < deadline, "the job did not reach step 50"
        time.sleep(0.1)
    before = job.status()
    first_node = node_of(job)
    victim = next(node for node in nodes.values() if node.node_id == first_node)
    report.update(step_at_removal=before.step, first_node=first_node, pid_before=before.coordinator_pid)
    removed_at, removed_wall = time.monotonic(), time.time()
    cluster.remove_node(victim, allow_graceful=False)
    shutil.rmtree(job.run_dir, ignore_errors=True)  # the node's disk went with it
    deadline = time.monotonic() + 120
    while True:
        try:
            status = job.status()
            report["last_seen"] = [status.state, status.incarnation, status.step]
            if status.incarnation >= 1:  # the new incarnation answers
                break
        except Exception as err:  # noqa: BLE001 - the coordinator is coming back
            report.setdefault("errors_while_restarting", []).append(str(err).splitlines()[0][:200])
        assert time.monotonic() < deadline, "the coordinator did not come back"
        time.sleep(0.1)
    report["restart_s"] = round(time.monotonic() - removed_at, 2)
    report["second_node"] = node_of(job)
    report["state_after_restart"] = status.state
    result = job.wait(timeout=300)
    report.update(state=result.state, step=result.step, history=[r["step"] for r in job.history()],
                  copied=[e["reason"] for e in job.events() if "copied down from" in e["reason"]],
                  copied_after_s=[round(e["time"] - removed_wall, 2) for e in job.events() if "copied down from" in e["reason"]],
                  reattached_after_s=[round(e["time"] - removed_wall, 2) for e in job.events() if e["kind"] == "restart"],
                  incarnation=job.status().incarnation)
finally:
    log = job.run_dir / "coordinator.log" if job.run_dir else None
    if log is not None and log.exists():
        report["coordinator_log"] = log.read_text()[-3000:]
    with open(out, "w") as fh:
        json.dump(report, fh)
    ray.shutdown()
    cluster.shutdown()
