"""Linux socket-descriptor scraping for gloo: which listening address a new gloo device took, and
shutting down one group's TCP pairs (what releases an operation stuck in C++ on an aborted group).

Gloo's own `abort()` and `shutdown()` do not release such an operation; the pairs are told apart from
every other socket of the process by the device's listening address and the peers' (`/proc/self/fd`).
"""
from __future__ import annotations

import os
import socket
import sys
import threading

import torch.distributed as dist

_DEVICE_LOCK = threading.Lock()
"""Serializes gloo device creation in this process, so that the listening socket a creation adds is
known to be its own."""


def _socket_fds() -> dict[int, str]:
    """This process's socket descriptors, each with its socket's identity ("socket:[inode]"): a number
    closed and reused by another socket meanwhile names a different socket."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if link.startswith("socket:"):
            fds[int(name)] = link
    return fds


def _addresses(fd: int) -> tuple[tuple[str, int], tuple[str, int] | None] | None:
    """(local, remote) TCP address of descriptor `fd` (remote None when not connected), read on a
    duplicate of it; None when it is not a TCP socket (any more)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return _addresses_of(sock)
    finally:
        sock.close()  # the duplicate


def _addresses_of(sock: socket.socket) -> tuple[tuple[str, int], tuple[str, int] | None] | None:
    """(local, remote) TCP address of `sock` (remote None when it listens); None when it is not a TCP
    socket or not connected."""
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local = sock.getsockname()[:2]
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return local, None
        try:
            remote = sock.getpeername()[:2]
        except OSError:  # not connected (yet, or any more)
            return None
        return local, remote
    except OSError:
        return None


_SPARE_DEVICES: dict[str, tuple[dist.ProcessGroupGloo.Device, tuple[str, int] | None]] = {}
"""A device made ahead for the next group on each address (`prepare_device`)."""


def device_and_address(node_ip: str) -> tuple[dist.ProcessGroupGloo.Device, tuple[str, int] | None]:
    """A gloo device bound to `node_ip`, and the address it listens on (None when it cannot be told
    apart: then an abort cannot shut its pairs down, and a stuck operation waits for its timeout).
    The one `prepare_device` made ahead if there is one: a re-form then pays no creation."""
    with _DEVICE_LOCK:
        spare = _SPARE_DEVICES.pop(node_ip, None)
        return spare if spare is not None else _new_device(node_ip)


def prepare_device(node_ip: str) -> None:
    """Make the next group's device on `node_ip` now, off a re-form's path (a device and the scan that
    finds its address took 4 ms of a re-form's 30 here, on two busy cores); one is kept per address."""
    with _DEVICE_LOCK:
        if node_ip not in _SPARE_DEVICES:
            _SPARE_DEVICES[node_ip] = _new_device(node_ip)


def _new_device(node_ip: str) -> tuple[dist.ProcessGroupGloo.Device, tuple[str, int] | None]:
    """A new device and its listening address; the caller holds `_DEVICE_LOCK`, so that the listening
    socket a creation adds is known to be its own."""
    before = set(_socket_fds().values()) if sys.platform.startswith("linux") else set()
    device = dist.ProcessGroupGloo.create_device(hostname=node_ip)
    if not sys.platform.startswith("linux"):
        return device, None
    listening = []
    # new sockets by identity, not by number: another thread may close a socket meanwhile and the
    # device's listening socket take its number (a member then could not shut its pairs down)
    for fd in [fd for fd, link in _socket_fds().items() if link not in before]:
        addresses = _addresses(fd)
        if addresses is not None and addresses[1] is None:
            listening.append(addresses[0])
    return device, (listening[0] if len(listening) == 1 else None)


def pairs(listen: tuple[str, int], peers: set[tuple[str, int]]) -> list[socket.socket]:
    """A duplicate of each connection of this process accepted on `listen` or made to one of `peers`:
    gloo's pairs of one group. The caller closes them (closing a duplicate leaves gloo's descriptor).

    Each descriptor is duplicated once, and the socket that duplicate names is the one checked and the
    one returned: between a check on one duplicate and a shutdown through another, gloo may close a
    pair's descriptor (its peer went away) and another thread of the process (Ray's own connections)
    open a socket under the same number, which would then be shut down in the pair's place."""
    found = []
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        addresses = _addresses_of(sock)
        if addresses is not None and addresses[1] is not None and (addresses[0] == listen or addresses[1] in peers):
            found.append(sock)
        else:
            sock.close()
    return found


def shut_down(socks: list[socket.socket]) -> int:
    """Shut down both directions of each socket (a pair's duplicate: gloo's descriptor names the same
    connection); returns how many were still open."""
    count = 0
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:  # closed, or not connected any more
            pass
    return count


def shut_down_pairs(listen: tuple[str, int], peers: set[tuple[str, int]]) -> int:
    """Shut down (both directions) gloo's pairs of one group (`pairs`), found now. Returns how many."""
    found = pairs(listen, peers)
    try:
        return shut_down(found)
    finally:
        for sock in found:
            sock.close()  # the duplicates only: gloo's descriptors stay, shut down
