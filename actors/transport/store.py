"""The group store's server side, without importing torch at module level.

Every worker serves a group store of its own (actors/training/worker.py `HostedStore`), and a membership
epoch's members rendezvous on their rank 0's; `EpochKeys` drops the keys of older epochs a store
hosted. `actors/transport/comm.py` re-exports these names for the clients' side. (The coordinator served the
job's one store before; it now serves none and never loads torch.)
"""
from __future__ import annotations

import datetime
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch.distributed as dist

log = logging.getLogger(__name__)

GROUP_SUFFIXES = ("", "/bg")
"""The groups of one membership epoch: the epoch's own, and the background kind's (actors/training/replica.py)."""


def group_keys(name: str, world_size: int, backend: str) -> list[str]:
    """The store keys a formed group leaves behind, as written through `group_store` (whose prefix adds
    a "/"): each rank's abort address, whether it attached the group's shared memory (where it has one:
    a key never written is skipped), and gloo's per-rank address under its device "0". NCCL's
    unique-id key is not listed (not measured: no GPU here), so an NCCL job still leaves one small
    key per epoch."""
    keys = []
    for rank in range(world_size):
        keys.append(f"{name}//gloo-listen/{rank}")
        if backend == "gloo":
            keys += [f"{name}//0/{rank}", f"{name}//shm/{rank}"]
    return keys


class EpochKeys:
    """Releases the store keys of past membership epochs. A worker reads its group's keys only while
    it forms the group; a member still forming the previous epoch is superseded, but may be reading,
    so the keys of the newest two epochs stay and older ones are deleted."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._live: list[tuple[str, int, str]] = []

    def entered(self, name: str, world_size: int, backend: str) -> None:
        self._live.append((name, world_size, backend))
        while len(self._live) > 2:
            old, size, kind = self._live.pop(0)
            for suffix in GROUP_SUFFIXES:
                for key in group_keys(old + suffix, size, kind):
                    try:
                        self.store.delete_key(key)
                    except Exception as err:  # noqa: BLE001 - a key never written (a group that never formed)
                        log.debug("store key %s: %s", key, err)


def serve_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int, socket.socket]:
    """Start the TCPStore server on a socket bound to `host` only (not all interfaces).

    The caller keeps the returned socket for as long as the store serves.
    """
    import torch.distributed as dist  # see the module docstring

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    return store, port, sock
