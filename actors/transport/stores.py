"""Store clients: each group formation's own connection to the coordinator's store, and in-process
stores that tests register under made-up addresses (no TCP)."""
from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist

_client_stores: dict[tuple[str, int], dist.Store] = {}
"""In-process stores that tests register under made-up addresses (no TCP)."""


def client_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client connection of its own for one group's formation. A TCPStore client runs one operation
    at a time: a formation abandoned for a newer epoch still blocks in C++ on its wait for peers that
    never come (up to its timeout), and a shared connection would hold every later formation of the
    process behind it. The group keeps its connection; it closes when the group is released."""
    local = _client_stores.get((host, port))
    if local is not None:
        return local
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


_in_process_stores = itertools.count()


def in_process_store() -> tuple[str, int]:
    """A `HashStore` that this process's communicators reach under a made-up address (no TCP)."""
    key = ("local-store", next(_in_process_stores) + 1)
    _client_stores[key] = dist.HashStore()
    return key
