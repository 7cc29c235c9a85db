"""All-reduce through shared memory, for a CPU group whose members all run on one node: each member's
side of it (`SharedMemoryGroup`), what a member publishes about it at formation (`Offer`) and the rule by
which every member decides alike whether the group uses it (`obstacle`). `GlooCommunicator`
(actors/transport/gloo.py) runs the formation's agreement through the group's signed store.

Gloo's all-reduce between two processes of one node goes through TCP on loopback and gloo's own worker
threads, each hop a wake-up: about 0.9 ms for the 38 KB of the digits MLP's gradients on this 2-core
machine, against about 20 us through shared memory (`python benchmarks/shm_allreduce.py`). That wait is
most of a small model's step, for this project's BSP and for torch DDP alike.

Each member owns one file in /dev/shm under a random name, a header (how many operations it launched,
how many it finished, its process id, its slot size) and two slots of the group's slot size, and one
named pipe it is woken through. The file's bytes are reserved when it is made (`posix_fallocate`), so
a small or full /dev/shm fails there (the group then uses gloo) and never later (a write into an
unreserved page of a full tmpfs is a SIGBUS). The member holds an `flock` on its file for as long as it
lives: a peer that can take that lock knows it is gone, at once, reaped or not.

An all-reduce's launch copies the tensor into the slot of its parity and publishes the launched count,
then writes a byte into each peer's pipe; its wait waits on the member's own pipe until every member has
launched it, reduces the members' slots in rank order into the tensor (so every member gets the same
bits) and publishes the finished count. A launch of operation k first finishes this member's k - 2, the
last one in the same slots (where its caller has not waited for it yet), and waits until every peer has
finished it too (at once, unless a peer runs two operations behind). Each count is one aligned 8-byte
store after the slot's copy or read, with no fence: that is correct only where stores are not
reordered with one another, as on x86-64, so `available` is true only there. The reductions are those
of `REDUCE_OPS`; any other is refused.

A wait honours the group's timeout and its abort (`wake` writes into the member's own pipe, so a wait
returns at once), and checks every `CHECK_S` that each peer still holds its lock: a peer that died
fails the wait with CommError (as gloo's reset connection does). One thread at a time issues a group's
operations, as with gloo.

Files: every member makes its file and pipe before the gloo group forms, and opens every peer's
(`attach`) right after it has formed, checking that each is a regular file (a pipe) owned by this user,
of the expected size, not through a link. Once every member has reported through the store that it
attached, each unlinks its own (`attached`): from then on a member killed even by SIGKILL leaves
nothing in /dev/shm. Only a member killed during its group's formation leaves its two files, until a
later group on the node settles (`sweep`: a file whose owner's lock is free is unlinked).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import glob
import mmap
import os
import platform
import secrets
import select
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from core.comm_api import CommAborted, CommError, CommTimeout

SLOT_BYTES = 64 * 2**20
"""The largest slot: a tensor larger than its group's slot goes through gloo (every member decides
alike: the tensors of one collective have one size)."""
UNSIZED_SLOT_BYTES = 4 * 2**20
"""The slot of a group whose spec does not say the largest tensor its members reduce (tools, tests)."""
HEADER = 64
DIRECTORY = "/dev/shm"
CHECK_S = 0.05
"""How often a wait checks that its peers are alive."""
COUNT, FINISHED, PID, SLOT = 0, 1, 2, 3
"""The header's fields (int64)."""
PREFIX = "orchestrator-"
REDUCE_OPS: dict[str, Callable[..., torch.Tensor]] = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
"""The reductions shared memory implements (`fn(a, b, out=)`); any other goes through gloo (`GlooCommunicator`)."""


_unlinked_at_exit: set[str] = set()
"""This process's files not unlinked yet (a group still forming, or never closed)."""


@atexit.register
def _unlink_at_exit() -> None:
    for path in list(_unlinked_at_exit):
        with contextlib.suppress(OSError):
            os.unlink(path)


def available() -> bool:
    """Shared memory is used on x86-64 Linux with /dev/shm, unless ORCHESTRATOR_SHM=0: its counts are
    published without a fence, which only x86's memory model keeps in order (see the module's docstring)."""
    return (platform.machine() in ("x86_64", "AMD64") and os.path.isdir(DIRECTORY)
            and os.environ.get("ORCHESTRATOR_SHM", "1") != "0")


def slot_bytes(reduce_bytes: int) -> int:
    """A group's slot for tensors of at most `reduce_bytes` (0: not known): whole pages, at most `SLOT_BYTES`."""
    wanted = reduce_bytes if reduce_bytes > 0 else UNSIZED_SLOT_BYTES
    return min(SLOT_BYTES, -(-wanted // mmap.PAGESIZE) * mmap.PAGESIZE)


def node_identity() -> str:
    """What "one node" means for shared memory: one boot, one /dev/shm (its device and inode) and one IPC
    namespace. Members whose identities differ (containers with host networking, each with its own
    /dev/shm) share an address but not these files."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    shm = os.stat(DIRECTORY)
    return f"{boot}/{shm.st_dev}/{shm.st_ino}/{os.stat('/proc/self/ns/ipc').st_ino}"


class Unusable(Exception):
    """This member cannot share memory with its group; the message says why in one line."""


def _describe(err: Exception, what: str) -> str:
    """One line: the error's own words (an OSError's without its number) and the file it concerns."""
    if isinstance(err, OSError):
        return f"{err.strerror or err}: {err.filename or what}"
    return f"{err}: {what}"


def _open_checked(path: str, flags: int, kind: int, size: int | None) -> int:
    """Open `path` without following a link or blocking, and only if it is a `kind` file (stat.S_IFREG,
    S_IFIFO) owned by this user, of `size` bytes where given: a file planted under a member's name by
    another user, a pipe under a file's name or a link is refused (OSError)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if stat.S_IFMT(st.st_mode) != kind or st.st_uid != os.geteuid() or (size is not None and st.st_size != size):
            what = "regular file" if kind == stat.S_IFREG else "named pipe"
            raise OSError(errno.EPERM, f"not this user's {what}" + (f" of {size} bytes" if size is not None else ""), path)
    except OSError:
        os.close(fd)
        raise
    return fd


def _failed(group: str, err: Exception) -> CommError:
    return CommError(f"group {group}: shared memory: {type(err).__name__}: {err}")


def _lock_free(fd: int) -> bool:
    """Whether the lock its owner holds on the file of `fd` is free (its owner is gone); releases it at once."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def sweep() -> int:
    """Unlink the files of members that died while their group formed (their lock is free); returns
    how many files. Each is opened without following a link or blocking, and only this user's regular
    files of a member's size are considered. Run off a re-form's path (`GlooCommunicator.settled`)."""
    removed = 0
    for seg in glob.glob(os.path.join(DIRECTORY, PREFIX + "*.seg")):
        try:
            fd = _open_checked(seg, os.O_RDONLY, stat.S_IFREG, None)
        except OSError:
            continue  # another user's, a pipe or a link, or unlinked meanwhile
        try:
            header = np.frombuffer(os.pread(fd, HEADER, 0).ljust(HEADER, b"\0"), dtype=np.int64)
            whole = int(header[SLOT]) > 0 and os.fstat(fd).st_size == HEADER + 2 * int(header[SLOT])
            gone = whole and _lock_free(fd)  # not whole: still being made (its maker locks it first)
        except OSError:
            gone = False
        finally:
            os.close(fd)
        if gone:
            removed += sum(_unlink_own(path) for path in (seg, seg[:-len(".seg")] + ".fifo"))
    return removed


def _unlink_own(path: str) -> bool:
    try:
        if os.lstat(path).st_uid != os.geteuid():
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def valid_name(name: str) -> bool:
    """A member's published name: `PREFIX` and 16 hex digits, nothing else (no path)."""
    token = name[len(PREFIX):]
    return name.startswith(PREFIX) and len(token) == 16 and all(c in "0123456789abcdef" for c in token)


@dataclass(frozen=True)
class Offer:
    """What a member publishes at formation: its file's name, its slot size and its node's identity, or
    why it has no file (`refused`)."""

    name: str = ""
    slot_bytes: int = 0
    node: str = ""
    refused: str = ""

    def encode(self) -> str:
        return f"no-shm {self.refused}" if self.refused else f"shm {self.name} {self.slot_bytes} {self.node}"

    @staticmethod
    def decode(text: str) -> Offer | None:
        """An offer as `encode` wrote it; None for nothing (a member that does not use shared memory)."""
        kind, _, rest = text.partition(" ")
        if kind == "no-shm":
            return Offer(refused=rest or "no reason given")
        fields = rest.split(" ")
        if kind != "shm" or len(fields) != 3 or not fields[1].isdigit():
            return None
        return Offer(fields[0], int(fields[1]), fields[2])


def obstacle(offers: list[Offer | None]) -> str | None:
    """Why a group whose members share an address cannot use shared memory, from every member's offer
    (in rank order): None where it can (each member then attaches), "" where a member does not use it
    (nothing to report), else one line. Every member decides alike: each reads the same offers."""
    if any(o is None for o in offers):
        return ""
    mine: list[Offer] = [o for o in offers if o is not None]
    refused: dict[str, list[str]] = {}
    for r, o in enumerate(mine):
        if o.refused:
            refused.setdefault(o.refused, []).append(str(r))
    if refused:
        return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {why}" for why, ranks in refused.items())
    if any(o.node != mine[0].node for o in mine):
        return ("the members do not share one /dev/shm and IPC namespace (boot id, /dev/shm device and inode, "
                "IPC namespace differ)")
    if any(o.slot_bytes != mine[0].slot_bytes for o in mine):
        return f"the members reserve different slot sizes ({sorted({o.slot_bytes for o in mine})})"
    return None


class SharedMemoryGroup:
    """One member's side of a group's shared-memory all-reduce (see the module's docstring)."""

    def __init__(self, rank: int, world_size: int, slot: int) -> None:
        """This member's file (its bytes reserved, its lock held) and pipe, under a random name (`offer`,
        published in the group's store with its gloo address). Unusable where they cannot be made."""
        self.rank, self.world_size, self.slot = rank, world_size, slot
        self.name = PREFIX + secrets.token_hex(8)
        self._size = HEADER + 2 * slot
        self._own_paths = [os.path.join(DIRECTORY, self.name + ".seg"), os.path.join(DIRECTORY, self.name + ".fifo")]
        self._mine: mmap.mmap | None = None
        self._own_fd = self._rfd = -1
        self._maps: list[mmap.mmap] = []
        self._headers: list[np.ndarray] = []
        self._peer_fds: list[int] = []
        self._wake_fds: list[int] = []
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.launched = 0
        self.finished = 0
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}
        """Launched and not finished: k -> (the caller's tensor, its flat contiguous form, the op)."""
        _unlinked_at_exit.update(self._own_paths)
        try:
            self._make()
            self.offer = Offer(self.name, slot, node_identity())
        except OSError as err:
            self.close()
            raise Unusable(_describe(err, f"{DIRECTORY} (reserving {self._size / 2**20:.1f} MiB)")) from None
        self._poll = select.poll()
        self._poll.register(self._rfd, select.POLLIN)

    def _make(self) -> None:
        self._own_fd = os.open(self._own_paths[0], os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._own_fd, fcntl.LOCK_EX)  # before its size is whole: `sweep` takes a whole file's free lock as death
        os.posix_fallocate(self._own_fd, 0, self._size)
        self._mine = mmap.mmap(self._own_fd, self._size)
        header = np.frombuffer(self._mine, dtype=np.int64, count=4)
        header[PID], header[SLOT] = os.getpid(), self.slot
        os.mkfifo(self._own_paths[1], 0o600)
        self._rfd = os.open(self._own_paths[1], os.O_RDWR | os.O_NONBLOCK)  # read; and write, to wake itself

    def attach(self, names: list[str]) -> None:
        """Open every member's file and pipe (`names` in rank order, this member's own at its rank).
        Nothing is kept unless every one opens: Unusable otherwise."""
        if len(names) != self.world_size or names[self.rank] != self.name or not all(map(valid_name, names)):
            raise Unusable(f"bad member names {names}")
        assert self._mine is not None  # made in __init__
        maps: dict[int, mmap.mmap] = {}
        fds: dict[int, int] = {}
        wake: list[int] = []
        try:
            for r, name in enumerate(names):
                if r != self.rank:
                    path = os.path.join(DIRECTORY, name)
                    fds[r] = _open_checked(path + ".seg", os.O_RDWR, stat.S_IFREG, self._size)
                    maps[r] = mmap.mmap(fds[r], self._size)
                    wake.append(_open_checked(path + ".fifo", os.O_WRONLY, stat.S_IFIFO, None))  # ENXIO: its reader is gone
        except (OSError, ValueError) as err:  # ValueError: mmap's, of a file shorter than its size said
            for m in maps.values():
                m.close()
            for fd in [*fds.values(), *wake]:
                os.close(fd)
            raise Unusable(_describe(err, f"a peer's file in {DIRECTORY}")) from None
        maps[self.rank], fds[self.rank] = self._mine, self._own_fd
        self._maps = [maps[r] for r in range(self.world_size)]
        self._peer_fds = [fds[r] for r in range(self.world_size)]
        self._wake_fds = wake
        self._headers = [np.frombuffer(m, dtype=np.int64, count=4) for m in self._maps]

    def attached(self) -> None:
        """Every member has attached: this member's own files are no longer needed by name."""
        self._unlink()

    def _slots(self, dtype: torch.dtype, numel: int, parity: int) -> list[torch.Tensor]:
        key = (dtype, numel, parity)
        views = self._views.get(key)
        if views is None:
            views = [torch.frombuffer(m, dtype=dtype, count=numel, offset=HEADER + parity * self.slot) for m in self._maps]
            self._views[key] = views
        return views

    def launch(self, tensor: torch.Tensor, op: str, timeout_s: float, aborted: Callable[[], bool], name: str) -> int:
        """Start reducing `tensor` (CPU, not empty, at most `slot` bytes; not to be touched until `finish`):
        returns the operation's number. CommError where the group was aborted, a peer is gone or late, the
        op is not one of `REDUCE_OPS`, or anything else fails."""
        if op not in REDUCE_OPS:
            raise CommError(f"group {name}: shared memory has no reduce op {op!r} (it has {', '.join(REDUCE_OPS)})")
        if not self._headers:
            raise CommError(f"group {name}: shared memory is not attached")
        try:
            k = self.launched + 1
            if k > 2:  # the slots of k - 2: this member finishes it (if its caller has not), and every peer must have
                self.finish(k - 2, timeout_s, aborted, name)
                self._wait(FINISHED, k - 2, time.monotonic() + timeout_s, aborted, name)
            if tensor.requires_grad:  # reduced in place, as gloo does, outside autograd
                tensor = tensor.detach()
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
            self._slots(tensor.dtype, flat.numel(), k % 2)[self.rank].copy_(flat)
            self._headers[self.rank][COUNT] = k
            self._wake()
        except CommError:
            raise
        except Exception as err:  # any failure fails the group, as gloo's would
            raise _failed(name, err) from err
        self.launched = k
        self._pending[k] = (tensor, flat, op)
        return k

    def finish(self, k: int, timeout_s: float, aborted: Callable[[], bool], name: str) -> None:
        """Finish every launched operation up to `k`, in order, within `timeout_s` in all: each tensor
        then holds the reduction."""
        deadline = time.monotonic() + timeout_s
        try:
            while self.finished < k:
                self._finish_next(deadline, aborted, name)
        except CommError:
            raise
        except Exception as err:  # as in launch
            raise _failed(name, err) from err

    def _finish_next(self, deadline: float, aborted: Callable[[], bool], name: str) -> None:
        j = self.finished + 1
        tensor, flat, op = self._pending[j]
        self._wait(COUNT, j, deadline, aborted, name)
        slots = self._slots(tensor.dtype, flat.numel(), j % 2)
        combine = REDUCE_OPS[op]
        combine(slots[0], slots[1], out=flat)
        for other in slots[2:]:
            combine(flat, other, out=flat)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        del self._pending[j]
        self.finished = j
        self._headers[self.rank][FINISHED] = j
        self._wake()

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
        """A peer whose lock is free is gone: its process exited, reaped or not (a zombie holds no files).
        Its process id is looked up too: a child it forked after the group formed shares its lock."""
        for r, fd in enumerate(self._peer_fds):
            if r != self.rank and (_lock_free(fd) or not _alive(int(self._headers[r][PID]))):
                raise CommError(f"group {name}: rank {r} (pid {int(self._headers[r][PID])}) is gone")

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
        """Unlink this member's files (if not yet), release its lock and let the mappings and pipes go."""
        self._unlink()
        self._views.clear()
        self._headers = []
        self._pending = {}
        for fd in {*self._wake_fds, *self._peer_fds, self._rfd, self._own_fd} - {-1}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_fds, self._peer_fds, self._rfd, self._own_fd = [], [], -1, -1
        for m in self._maps or ([self._mine] if self._mine is not None else []):
            with contextlib.suppress(BufferError, ValueError):  # a view still held: it goes with the last reference
                m.close()
        self._maps, self._mine = [], None
