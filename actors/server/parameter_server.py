"""The parameter server's host for a job's policy (`make_host`).

A server policy (asp, ssp, quorum, elastic_bsp) runs a `ServerHost` (actors/server/server_host.py); the
background kind (shadow) runs a `DispenserHost`, its lease dispenser and central copy
(actors/server/dispenser_host.py). `ParameterServer` (actors/server/server_actor.py) is the Ray actor around either;
a worker reaches it through a `RayServerClient`, a test through a `LocalServerClient`
(actors/server/server_client.py).
"""
from __future__ import annotations

from actors.server.dispenser_host import DispenserHost
from actors.server.server_host import ServerHost, ServerReports
from algorithms.policies.base import get_algorithm


def make_host(config: dict, run_dir: str, reports: ServerReports, restarted: bool = False) -> ServerHost:
    """The host for the job's policy: a `DispenserHost` for the background kind, else a `ServerHost`."""
    kind = get_algorithm(str(config.get("sync", {}).get("policy", "bsp"))).kind
    return (DispenserHost if kind.dispenses_leases else ServerHost)(config, run_dir, reports, restarted=restarted)
