"""A local Ray cluster of several nodes on the network lab's addresses, for tests of what runs on a real
multi-node cluster (the cluster probe of `plan --probe` and `auto`): node k of `network:` is a Ray node
(its own raylet, object store and workers) whose IP is the lab's address for node k, so traffic between
two nodes crosses the lab's shaped link between them.

Every process of node k preloads the lab's connect() shim with `ORCHESTRATOR_LAB_SOURCE` set to the
node's address (on one machine the kernel would give every loopback connection the source 127.0.0.1,
which no shaping rule can tell apart; on a real cluster each node's own NIC does this). The lab must be
up (`orchestrator.lab.Lab`). The cluster lives in a child process of its own (`python -m
testkit.lab_cluster NETWORK_JSON`: Ray's `Cluster.shutdown()` resets its process's Ray client state, which
would break a test session's own Ray); the child stops the nodes by their ids when its stdin closes."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from actors.transport.lab_shim import shim_path
from core.schema import NetworkConfig, parse

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _environment(update: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(update)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def lab_cluster(net: NetworkConfig, cpus_per_node: float = 1, timeout: float = 120) -> Iterator[str]:
    """Yields the cluster's address (for RAY_ADDRESS) once all `net.nodes` nodes are up."""
    from testkit.harness import child_env

    spec = json.dumps({"network": dataclasses.asdict(net), "cpus_per_node": cpus_per_node})
    child = subprocess.Popen([sys.executable, "-m", "testkit.lab_cluster", spec], cwd=REPO, env=child_env(REPO),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stdin, stdout = child.stdin, child.stdout
    if stdin is None or stdout is None:  # both are pipes (PIPE above): never None
        child.kill()
        raise RuntimeError("the lab cluster's pipes did not open")
    try:
        line = stdout.readline().strip()  # the child's first line: the address, once every node is up
        if not line.startswith("address "):
            raise RuntimeError(f"the lab cluster did not come up (exit {child.poll()}): {line!r}")
        yield line.split(" ", 1)[1]
    finally:
        stdin.close()
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextlib.contextmanager
def _cluster(net: NetworkConfig, cpus_per_node: float) -> Iterator[str]:
    from ray.cluster_utils import Cluster

    from orchestrator.job import ensure_token_env

    ensure_token_env()  # the cluster and the clients that attach to it agree on Ray's token auth
    shim = str(shim_path())

    def node_env(node: int) -> dict[str, str]:
        return {"LD_PRELOAD": shim, "ORCHESTRATOR_LAB_NET": net.subnet, "ORCHESTRATOR_LAB_SOURCE": net.address(node)}

    with _environment(node_env(0)):
        cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": net.address(0), "num_cpus": cpus_per_node, "include_dashboard": False})
    try:
        for node in range(1, net.nodes):
            with _environment(node_env(node)):
                cluster.add_node(node_ip_address=net.address(node), num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)  # a new cluster, not the one the parent may be attached to
    given = json.loads(sys.argv[1])
    with _cluster(parse(NetworkConfig, given["network"], "network"), given["cpus_per_node"]) as address:
        print(f"address {address}", flush=True)
        sys.stdin.read()  # until the parent closes it
