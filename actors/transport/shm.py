"""All-reduce through shared memory, for a CPU group whose members all run on one node.

Gloo's all-reduce between two processes of one node goes through TCP on loopback and gloo's own worker
threads, each hop a wake-up: about 0.9 ms for the 38 KB of the digits MLP's gradients on this 2-core
machine, against about 20 us through shared memory (`python benchmarks/shm_allreduce.py`). That wait is
most of a small model's step, for this project's BSP and for torch DDP alike.

Each member owns one file in /dev/shm under a random name it publishes with its gloo address in the
group's store (signed, as every rendezvous value), a header (how many operations it launched, how many it
finished, its process id) and two slots of `SLOT_BYTES` (sparse: only what a tensor touches takes
memory), and one named pipe it is woken through. An all-reduce's launch copies the tensor into the slot
of its parity and publishes the launched count, then writes a byte into each peer's pipe; its wait
waits on the member's own pipe until every member has launched it, sums the members' slots in rank
order into the tensor (so every member gets the same bits) and publishes the finished count. A launch
of operation k first finishes this member's k - 2, the last one in the same slots (where its caller has
not waited for it yet), and waits until every peer has finished it too (at once, unless a peer runs
two operations behind). Each count is one aligned 8-byte store after the slot's
copy or read; x86's stores are not reordered with one another (`available` holds only there).

A member that dies mid-operation publishes nothing more: a wait checks, every `CHECK_S`, that each
peer's process is alive, and fails with CommError when one is gone (as gloo's reset connection does),
without waiting for the abort.

Every member creates its file and pipe before the gloo group forms, so once the group has formed all
exist; a member opens its peers' at its first operation, and once that operation is done (every peer
has published, so every peer has opened everything) it unlinks its own: a member killed after that
leaves nothing in /dev/shm. A group closed or a process that exits before then unlinks them too; only a
member killed between its group's formation and its first operation leaves its two files, until a
later group on the node settles (`sweep`: a file whose member's process is gone is unlinked). A wait
honours the group's timeout and its abort (`wake` writes into the member's own pipe, so a wait returns
at once). One thread at a time issues a group's operations, as with gloo.
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import mmap
import os
import platform
import secrets
import select
import time
from collections.abc import Callable

import numpy as np
import torch

from core.comm_api import CommAborted, CommError, CommTimeout

SLOT_BYTES = 64 * 2**20
"""Largest tensor one operation carries through shared memory; a larger one goes through gloo (every
member decides alike: the tensors of one collective have one size)."""
HEADER = 64
DIRECTORY = "/dev/shm"
CHECK_S = 0.05
"""How often a wait checks that its peers' processes are alive."""
COUNT, FINISHED, PID = 0, 1, 2
"""The header's fields (int64)."""


_unlinked_at_exit: set[str] = set()
"""This process's files not unlinked yet (a group that formed but never ran an operation, nor closed)."""


@atexit.register
def _unlink_at_exit() -> None:
    for path in list(_unlinked_at_exit):
        with contextlib.suppress(OSError):
            os.unlink(path)


def available() -> bool:
    """Shared memory is used on x86-64 Linux with /dev/shm, unless ORCHESTRATOR_SHM=0."""
    return (platform.machine() in ("x86_64", "AMD64") and os.path.isdir(DIRECTORY)
            and os.environ.get("ORCHESTRATOR_SHM", "1") != "0")


def sweep() -> int:
    """Unlink the files of members whose process is gone (killed between a group's formation and its first
    operation); returns how many files. Run off a re-form's path (`GlooCommunicator.settled`)."""
    removed = 0
    for seg in glob.glob(os.path.join(DIRECTORY, PREFIX + "*.seg")):
        try:
            with open(seg, "rb") as f:
                pid = int(np.frombuffer(f.read(8 * 3), dtype=np.int64)[PID])
            os.kill(pid, 0)
        except ProcessLookupError:
            for path in (seg, seg[:-len(".seg")] + ".fifo"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed += 1
        except (OSError, ValueError, IndexError):
            continue  # another user's, unlinked meanwhile, or not yet written
    return removed


PREFIX = "orchestrator-"


def valid_name(name: str) -> bool:
    """A member's published name: `PREFIX` and 16 hex digits, nothing else (no path)."""
    token = name[len(PREFIX):]
    return name.startswith(PREFIX) and len(token) == 16 and all(c in "0123456789abcdef" for c in token)


class SharedMemoryGroup:
    """One member's side of a group's shared-memory all-reduce (see the module's docstring)."""

    def __init__(self, rank: int, world_size: int) -> None:
        """This member's file and pipe, under a random name (`name`, which the member publishes in the
        group's store with its gloo address; `attach` takes the peers')."""
        self.rank, self.world_size = rank, world_size
        self.name = PREFIX + secrets.token_hex(8)
        self._own_paths = [os.path.join(DIRECTORY, self.name + ".seg"), os.path.join(DIRECTORY, self.name + ".fifo")]
        self._peer_names: list[str] = []
        self._mine: mmap.mmap | None = None
        self._rfd = -1
        _unlinked_at_exit.update(self._own_paths)
        try:
            fd = os.open(self._own_paths[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, HEADER + 2 * SLOT_BYTES)
                self._mine = mmap.mmap(fd, HEADER + 2 * SLOT_BYTES)
            finally:
                os.close(fd)
            np.frombuffer(self._mine, dtype=np.int64, count=3)[PID] = os.getpid()
            os.mkfifo(self._own_paths[1], 0o600)
            self._rfd = os.open(self._own_paths[1], os.O_RDWR | os.O_NONBLOCK)  # read; and write, to wake itself
        except OSError:
            self.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._rfd, select.POLLIN)
        self._maps: list[mmap.mmap] = []
        self._headers: list[np.ndarray] = []
        self._wake_fds: list[int] = []
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.launched = 0
        self.finished = 0
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}
        """Launched and not finished: k -> (the caller's tensor, its flat contiguous form, the op)."""

    def peers(self, names: list[str]) -> None:
        """Every member's published name, in rank order (this member's own at its rank)."""
        if len(names) != self.world_size or names[self.rank] != self.name or not all(map(valid_name, names)):
            raise ValueError(f"shared memory: bad member names {names}")
        self._peer_names = list(names)

    def _attach(self) -> None:
        """Open every peer's file and pipe (they exist: each member made its own before the group formed)."""
        assert self._mine is not None and self._peer_names  # made in __init__; named by `peers`
        for r, name in enumerate(self._peer_names):
            if r == self.rank:
                self._maps.append(self._mine)
                continue
            fd = os.open(os.path.join(DIRECTORY, name + ".seg"), os.O_RDWR)
            try:
                self._maps.append(mmap.mmap(fd, HEADER + 2 * SLOT_BYTES))
            finally:
                os.close(fd)
            self._wake_fds.append(os.open(os.path.join(DIRECTORY, name + ".fifo"), os.O_WRONLY | os.O_NONBLOCK))
        self._headers = [np.frombuffer(m, dtype=np.int64, count=3) for m in self._maps]

    def _slots(self, dtype: torch.dtype, numel: int, parity: int) -> list[torch.Tensor]:
        key = (dtype, numel, parity)
        views = self._views.get(key)
        if views is None:
            views = [torch.frombuffer(m, dtype=dtype, count=numel, offset=HEADER + parity * SLOT_BYTES) for m in self._maps]
            self._views[key] = views
        return views

    def launch(self, tensor: torch.Tensor, op: str, timeout_s: float, aborted: Callable[[], bool], name: str) -> int:
        """Start reducing `tensor` (CPU, at most SLOT_BYTES; not to be touched until `finish`): returns
        the operation's number. CommError where the group was aborted, a peer is gone or late."""
        try:
            if not self._maps:
                self._attach()
        except OSError as err:
            raise CommError(f"group {name}: shared memory: {err}") from None
        k = self.launched + 1
        if k > 2:  # the slots of k - 2: this member finishes it (if its caller has not), and every peer must have
            self.finish(k - 2, timeout_s, aborted, name)
            self._wait(FINISHED, k - 2, time.monotonic() + timeout_s, aborted, name)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        self._slots(tensor.dtype, flat.numel(), k % 2)[self.rank].copy_(flat)
        self._headers[self.rank][COUNT] = k
        self._wake()
        self.launched = k
        self._pending[k] = (tensor, flat, op)
        return k

    def finish(self, k: int, timeout_s: float, aborted: Callable[[], bool], name: str) -> None:
        """Finish every launched operation up to `k`, in order: each tensor then holds the reduction."""
        while self.finished < k:
            j = self.finished + 1
            tensor, flat, op = self._pending[j]
            self._wait(COUNT, j, time.monotonic() + timeout_s, aborted, name)
            slots = self._slots(tensor.dtype, flat.numel(), j % 2)
            if op == "sum":
                torch.add(slots[0], slots[1], out=flat)
                for other in slots[2:]:
                    flat.add_(other)
            else:
                combine = torch.maximum if op == "max" else torch.minimum
                combine(slots[0], slots[1], out=flat)
                for other in slots[2:]:
                    combine(flat, other, out=flat)
            if flat.data_ptr() != tensor.data_ptr():
                tensor.copy_(flat.view_as(tensor))
            del self._pending[j]
            self.finished = j
            self._headers[self.rank][FINISHED] = j
            self._wake()
            if j == 1:
                self._unlink()  # every peer launched it: each has opened this member's file and pipe

    def _wake(self) -> None:
        for fd in self._wake_fds:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):  # a full pipe wakes it anyway; a dead peer, nothing
                os.write(fd, b"\0")

    def _wait(self, field: int, k: int, deadline: float, aborted: Callable[[], bool], name: str) -> None:
        """Until every member's `field` is at least `k`."""
        checked = time.monotonic()
        while True:
            if all(int(h[field]) >= k for h in self._headers):
                return
            if aborted():
                raise CommAborted(f"group {name}: membership epoch aborted")
            now = time.monotonic()
            if now >= deadline:
                raise CommTimeout(f"group {name}: a peer did not reach shared-memory operation {k} in time")
            if now - checked >= CHECK_S:
                checked = now
                self._check_peers(name)
            self._poll.poll(max(1, int(min(deadline - now, CHECK_S) * 1000)))
            with contextlib.suppress(BlockingIOError):
                os.read(self._rfd, 4096)

    def _check_peers(self, name: str) -> None:
        for r, header in enumerate(self._headers):
            pid = int(header[PID])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise CommError(f"group {name}: rank {r} (pid {pid}) is gone") from None
            except PermissionError:
                pass  # alive, another user's

    def wake(self) -> None:
        """Release a wait now (an abort: it then sees the group aborted)."""
        if self._rfd >= 0:
            with contextlib.suppress(OSError):
                os.write(self._rfd, b"\1")

    def _unlink(self) -> None:
        for path in self._own_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            _unlinked_at_exit.discard(path)

    def close(self) -> None:
        """Unlink this member's files (if not yet) and let the mappings and pipes go."""
        self._unlink()
        self._views.clear()
        self._headers = []
        self._pending = {}
        for fd in [*self._wake_fds, self._rfd]:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_fds, self._rfd = [], -1
        for m in self._maps or ([self._mine] if self._mine is not None else []):
            with contextlib.suppress(BufferError, ValueError):  # a view still held: it goes with the last reference
                m.close()
        self._maps, self._mine = [], None
