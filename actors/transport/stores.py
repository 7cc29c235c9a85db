"""Store clients: each group formation's own connection to the coordinator's store, and in-process
stores that tests register under made-up addresses (no TCP)."""
from __future__ import annotations

import datetime
import itertools
import threading

import torch.distributed as dist

_client_stores: dict[tuple[str, int], dist.Store] = {}
"""In-process stores that tests register under made-up addresses (no TCP)."""


_spare_client: dict[tuple[str, int, float], dist.Store] = {}
"""A client connected ahead (`prepare_client`) to the store the next formation most likely uses."""
_spare_lock = threading.Lock()


def client_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client connection of its own for one group's formation. A TCPStore client runs one operation
    at a time: a formation abandoned for a newer epoch still blocks in C++ on its wait for peers that
    never come (up to its timeout), and a shared connection would hold every later formation of the
    process behind it. The group keeps its connection; it closes when the group is released. The one
    `prepare_client` connected ahead to this store, if any: a re-form then pays no connection."""
    local = _client_stores.get((host, port))
    if local is not None:
        return local
    with _spare_lock:
        spare = _spare_client.pop((host, port, timeout_s), None)
    return spare if spare is not None else dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


def prepare_client(host: str, port: int, timeout_s: float) -> None:
    """Connect the next formation's client to this store now, off a re-form's path (a new client took
    2.5 ms of a re-form's 30 here, on two busy cores): the next plan names the same store unless the
    member that serves it left. One is kept, for the newest store asked for."""
    if (host, port) in _client_stores:
        return
    key = (host, port, timeout_s)
    with _spare_lock:
        if key in _spare_client:
            return
    client = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    with _spare_lock:
        _spare_client.clear()  # another store's: it closes with its last reference
        _spare_client[key] = client


_in_process_stores = itertools.count()


def in_process_store() -> tuple[str, int]:
    """A `HashStore` that this process's communicators reach under a made-up address (no TCP)."""
    key = ("local-store", next(_in_process_stores) + 1)
    _client_stores[key] = dist.HashStore()
    return key
