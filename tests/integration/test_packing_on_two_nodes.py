"""Workers packed onto nodes on a real two-node Ray cluster (actors/control/placement.py): the nodes'
room and the actors' places come from Ray's GCS and each worker is sent with Ray's node affinity, soft
and spilling to another node where the room went, as `RayWorkerGroup.create` does. Two worker nodes
of 3 CPUs (a head with none) take four 1-CPU actors created in a burst: three on one node, one on the
other; a death on the full node is replaced there. Ray's DEFAULT strategy, run after for comparison,
is printed, not asserted (its spreading is Ray's).

It runs in a child process: the cluster's nodes are Ray instances of their own, not the session's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.harness import child_env

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import collections, json, time, ray
from ray.cluster_utils import Cluster
from actors.control.placement import NodePacker, ray_place_of, ray_rooms

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
nodes = [cluster.add_node(num_cpus=3) for _ in range(2)]
ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
cluster.wait_for_nodes()

@ray.remote(num_cpus=1)
class Worker:
    def node(self):
        return ray.get_runtime_context().get_node_id()

def create(node, strategy="DEFAULT"):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    if node is not None:
        strategy = NodeAffinitySchedulingStrategy(node, soft=True, _spill_on_unavailable=True)
    return Worker.options(scheduling_strategy=strategy).remote()

packer = NodePacker({"CPU": 1}, ray_rooms, ray_place_of)
actor_id = lambda handle: handle._actor_id.hex()
workers = [packer.place(create, actor_id) for _ in range(4)]
where = ray.get([w.node.remote() for w in workers])
full = collections.Counter(where).most_common(1)[0][0]
victim = next(w for w, n in zip(workers, where) if n == full)
ray.kill(victim)
while not ray_place_of(actor_id(victim)).dead:  # the coordinator replaces a worker it has seen die
    time.sleep(0.01)
replacement = packer.place(create, actor_id)
out = {"packed": sorted(collections.Counter(where).values()),
       "replaced_on_full_node": ray.get(replacement.node.remote()) == full}
for w in workers + [replacement]:
    ray.kill(w)
default = [create(None) for _ in range(4)]
out["default"] = sorted(collections.Counter(ray.get([w.node.remote() for w in default])).values())
print(json.dumps(out))
ray.shutdown()
cluster.shutdown()
"""


def test_four_workers_on_two_3_cpu_nodes_are_packed_three_and_one_and_a_replacement_goes_back():
    env = child_env(REPO)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"packed {result['packed']}; Ray's DEFAULT strategy gave {result['default']}")
    assert result["packed"] == [1, 3]
    assert result["replaced_on_full_node"]
