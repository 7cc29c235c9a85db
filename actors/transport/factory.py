"""Forming one membership epoch's group: the backend its spec names (`make_communicator`), and n
members of one gloo group in threads of this process (tests: `in_process_group`)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from actors.transport.base import BaseCommunicator
from actors.transport.gloo import GlooCommunicator
from actors.transport.nccl import NcclCommunicator
from actors.transport.stores import client_store, in_process_store
from core.comm_api import CommError, GroupSpec


def in_process_group(n: int, name: str = "local", timeout_s: float = 10.0) -> list[BaseCommunicator]:
    """n members of one gloo group, formed in threads of this process (tests)."""
    host, port = in_process_store()
    specs = [GroupSpec(host, port, name, r, n, timeout_s, "gloo", "127.0.0.1") for r in range(n)]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(make_communicator, specs))


def make_communicator(spec: GroupSpec) -> GlooCommunicator | NcclCommunicator:
    """Form the group of one membership epoch (blocks until every member arrives or timeout)."""
    try:
        store = client_store(spec.store_host, spec.store_port, spec.forming_s)
    except Exception as err:  # noqa: BLE001
        raise CommError(f"store {spec.store_host}:{spec.store_port} unreachable: {str(err).splitlines()[0][:200]}") from None
    if spec.backend == "nccl":
        return NcclCommunicator(spec, store)
    return GlooCommunicator(spec, store)
