"""A run's copy on remote storage, kept up to date from its local working folder by a thread.

With `storage:` an object store, the coordinator still writes the run's files to a local folder as
before: appends, fsync and rename are cheap there, and the event loop never waits on a network. A
`RunMirror` copies them to `<storage>/<job>/<run id>/`:

- a whole file (`coordinator.json`, `model.pt`, `status.json`, ...) when `put` names it: the newest
  content wins (puts that arrive while one uploads are coalesced, as the state file's writer does);
- an appended file (`history.jsonl`, `events.jsonl`, `step_times.jsonl`) as parts that are never
  rewritten, `<name>.parts/c<incarnation>/<start>-<end>`, each holding the complete lines appended
  since the part before it (a line still being written waits for its newline). A file's next part goes
  up once `PART_BYTES` are pending, or else once `MAX_LAG_S` have passed since its last part, and at
  once on `flush`. So each byte is uploaded once, and a pass reads only the bytes it uploads. The cost
  is the number of objects: at most one per file every `MAX_LAG_S` (17,280 a day at 5 s) beyond one per
  `PART_BYTES`. A reader lists them once and fetches `READERS` at a time.

Fencing between coordinator incarnations (actors/runs/fencing.py): the coordinator claims its incarnation
under `<run>/incarnations/` before its mirror starts. Before each write, the mirror lists the claims.
Once one names a newer incarnation, the mirror stops writing for good (`fenced`) and says so once
through `on_error`. This check is not atomic with the write after it (pyarrow has no conditional
writes), so a zombie's write that was already under way still lands. The part keys make that harmless
for appended files: the reader (`appended_pieces`) takes the newest incarnation's parts from its first
start, and each older incarnation's bytes only up to the first start of the ones after it. A zombie's
later parts are thus never read. A mirror that finds some of a file on the store begins by writing an
empty part at the offset it carries on from, which marks that start at once. Parts from before incarnations were in the keys
(`<name>.parts/<start>-<end>`) count as the oldest incarnation, and a compacted part among them (one
from 0) still covers the parts it replaced.

`hydrate()` works the other way. A coordinator that Ray restarted on another node finds an empty local
folder, and first copies down what the store has (the state file, history, events), so that it carries
on from there as a restart on the same node does.

Upload failures never reach the caller: they are retried every `interval_s`, and `on_error` hears
each one once until a pass succeeds (the coordinator makes it an event).
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

from actors.runs import fencing, runfiles
from actors.runs.storage import Storage, first_line

log = logging.getLogger(__name__)

APPENDED = ("history.jsonl", "events.jsonl", "step_times.jsonl")
SAVED = "coordinator.json"
WHOLE = (SAVED, "faults_fired.json", "config.yaml", "coordinator_faults_fired.json")
"""What a restarted coordinator reads back (hydrate), besides the appended files."""
PART_BYTES = 4 << 20
"""Pending bytes that make a part at once; also the most a part holds (unless one line is longer)."""
MAX_LAG_S = 5.0
"""The longest an appended file's complete lines wait for their part (after the file's previous part)."""
READERS = 8
"""Parts fetched at a time by a reader."""


def parts_key(name: str) -> str:
    return f"{name}.parts"


def claims_key(run_key: str) -> str:
    """Where a run's coordinator incarnations are claimed (actors/runs/fencing.py)."""
    return f"{run_key.strip('/')}/incarnations"


def claim_incarnation(storage: Storage, run_key: str, local_dir: Path, at_least: int = 0) -> int:
    """A coordinator's incarnation, claimed on the store (actors/runs/fencing.py): above every one claimed
    there, and above the one in the state file, here or on the store (a run mirrored before incarnations
    were claimed has no claims)."""
    for read in (lambda: (Path(local_dir) / SAVED).read_bytes(), lambda: storage.read(f"{run_key}/{SAVED}")):
        try:
            at_least = max(at_least, int(json.loads(read())["incarnation"]) + 1)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return fencing.claim(storage, claims_key(run_key), at_least)


@dataclass(frozen=True)
class Piece:
    """Bytes `[skip, skip + size)` of the part `key`: one stretch of an appended file."""

    key: str
    skip: int
    size: int


def _span(name: str) -> tuple[int, int] | None:
    try:
        start, end = name.split("-")
        return int(start), int(end)
    except ValueError:
        return None


def _parts(storage: Storage, key: str) -> dict[int, list[tuple[int, int, str]]]:
    """(start, end, part key) of an appended file's parts by incarnation (-1: from before incarnations
    were in the keys), from one listing."""
    root = parts_key(key) + "/"
    found: dict[int, list[tuple[int, int, str]]] = {}
    for part, _ in storage.list(parts_key(key)):
        folder, _, name = part[len(root):].rpartition("/")
        span = _span(name)
        if span is None or (folder and not (folder[:1] == "c" and folder[1:].isdigit())):
            continue
        found.setdefault(int(folder[1:]) if folder else -1, []).append((*span, part))
    return found


def appended_pieces(storage: Storage, key: str) -> list[Piece]:
    """What an appended file is made of, in order, each byte once: each incarnation's parts from its
    first start, and an older incarnation's only up to the first start of the newer ones. A hole ends
    the file there (the bytes after it are not trusted)."""
    ranges: list[tuple[list[tuple[int, int, str]], float]] = []
    limit = math.inf
    by_incarnation = _parts(storage, key)
    for incarnation in sorted(by_incarnation, reverse=True):
        spans = sorted(by_incarnation[incarnation], key=lambda s: (s[0], -s[1]))
        ranges.append((spans, limit))
        limit = min(limit, spans[0][0])
    pieces: list[Piece] = []
    length = 0
    for spans, until in reversed(ranges):
        for start, end, part in spans:
            end = int(min(end, until))
            if end <= length:
                continue  # covered already (a compacted part of the old layout), or past `until`
            if start > length:
                log.warning("%s: a hole at byte %d (the next part starts at %d); read up to it",
                            storage.location(key), length, start)
                return pieces
            pieces.append(Piece(part, length - start, end - length))
            length = end
    return pieces


def appended_size(storage: Storage, key: str) -> int:
    """How many bytes of an appended file the store holds (from the listing alone)."""
    return sum(piece.size for piece in appended_pieces(storage, key))


def read_appended(storage: Storage, key: str) -> bytes:
    """An appended file's bytes as mirrored (see `appended_pieces`)."""
    return b"".join(_fetch(storage, appended_pieces(storage, key)))


def _fetch(storage: Storage, pieces: list[Piece]) -> Iterator[bytes]:
    """The pieces' bytes in order, fetched `READERS` at a time with at most twice that in hand. A part
    gone since the listing ends them there."""
    if not pieces:
        return
    todo = iter(pieces)
    with ThreadPoolExecutor(max_workers=min(READERS, len(pieces)), thread_name_prefix="part reader") as pool:
        window = deque(pool.submit(_read_piece, storage, piece) for piece in itertools.islice(todo, 2 * READERS))
        while window:
            try:
                data = window.popleft().result()
            except FileNotFoundError as err:
                log.warning("a part is gone since it was listed (%s); read up to it", err)
                for future in window:
                    future.cancel()
                return
            window.extend(pool.submit(_read_piece, storage, piece) for piece in itertools.islice(todo, 1))
            yield data


def _read_piece(storage: Storage, piece: Piece) -> bytes:
    data = storage.read(piece.key)[piece.skip:piece.skip + piece.size]
    if len(data) != piece.size:
        raise FileNotFoundError(f"{piece.key} (it holds fewer bytes than its name says)")
    return data


def _complete_lines(src: BinaryIO, offset: int, size: int, most: int) -> bytes:
    """The file's bytes from `offset` up to its last newline within `most` bytes (or, when there is
    none there, up to the first newline after: one line longer than `most`); b"" when the line at
    `offset` is not finished yet. Only the bytes past `offset` are read."""
    src.seek(offset)
    data = src.read(min(most, size - offset))
    cut = data.rfind(b"\n") + 1
    if cut:
        return data[:cut]
    while offset + len(data) < size:
        more = src.read(min(most, size - offset - len(data)))
        if not more:
            break
        at = more.find(b"\n")
        if at >= 0:
            return data + more[:at + 1]
        data += more
    return b""


class _Fenced(Exception):
    """A newer incarnation owns the run's copy: this mirror writes nothing more."""


class RunMirror:
    """Copies one local run folder to `storage` under `key` (`<job>/<run id>`), as coordinator
    incarnation `incarnation` (claimed under `claims_key(key)` by the caller)."""

    def __init__(self, storage: Storage, key: str, local_dir: Path, incarnation: int = 0,
                 appended: tuple[str, ...] = APPENDED, interval_s: float = 1.0,
                 on_error: Callable[[str], None] | None = None, part_bytes: int = PART_BYTES,
                 max_lag_s: float = MAX_LAG_S) -> None:
        self.storage, self.key, self.local_dir = storage, key.strip("/"), Path(local_dir)
        self.incarnation = incarnation
        self.appended = appended
        self.interval_s, self.part_bytes, self.max_lag_s = interval_s, part_bytes, max_lag_s
        self.on_error = on_error or (lambda message: log.warning("%s", message))
        self._cond = threading.Condition()
        self._puts: dict[str, None] = {}  # ordered set of names to upload whole
        self._offsets: dict[str, int] = {}
        self._last_part: dict[str, float] = {}
        self._marks: list[str] = []
        self._asked = 0
        self._forced = 0
        self._done = 0
        self._error = ""
        self._said: set[str] = set()
        """The failures `on_error` heard since the last pass that succeeded."""
        self._fenced = False
        self._synced_at: float | None = None
        self._closed = False
        self.uploaded_bytes = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the caller's side
    def start(self) -> RunMirror:
        """Begin mirroring: what the store already holds of each appended file (and this folder holds
        too) is not sent again."""
        stored = {name: appended_size(self.storage, self._k(name)) for name in self.appended}
        for name in self.appended:
            local = self.local_dir / name
            self._offsets[name] = min(stored[name], local.stat().st_size if local.exists() else 0)
        with self._cond:
            self._marks = [name for name in self.appended if stored[name]]  # older bytes to cut off here
            self._asked += 1  # the first pass (the marks) at once
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"mirror of {self.key}")
        self._thread.start()
        return self

    def put(self, name: str) -> None:
        """Upload the local file `name` (relative to the run folder) as it is when its turn comes."""
        with self._cond:
            self._puts[name] = None
            self._asked += 1
            self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every put and every complete line appended so far is in the store; False on
        timeout, or once fenced."""
        with self._cond:
            self._asked += 1
            wanted = self._forced = self._asked
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._done >= wanted or self._closed or self._fenced, timeout)
            return done and not self._fenced

    @property
    def error(self) -> str:
        """The newest upload failure, "" once a pass succeeds; once fenced, that it is."""
        return self._error

    def lag_s(self) -> float:
        """Seconds since a pass last found the store taking every upload (0 before the first pass):
        grows while the store fails or a newer incarnation fenced this one off. Appended lines wait
        up to `max_lag_s` more by design; that wait is not counted."""
        return 0.0 if self._synced_at is None else max(0.0, time.monotonic() - self._synced_at)

    @property
    def fenced(self) -> bool:
        """True once the store named a newer incarnation: nothing is written from then on."""
        return self._fenced

    def close(self, timeout: float = 30.0) -> bool:
        """Flush, then stop the thread. False when something could not be uploaded in time."""
        ok = self.flush(timeout) if self._thread is not None else not self._fenced
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return ok

    def hydrate(self, names: tuple[str, ...] = WHOLE) -> list[str]:
        """Copy down what the store has and the local folder lacks (or has less of): the whole files
        `names` when missing here, each appended file when the store holds more of it. Returns the
        names copied."""
        copied = []
        for name in names:
            local = self.local_dir / name
            if local.exists():
                continue
            try:
                data = self.storage.read(self._k(name))
            except FileNotFoundError:
                continue
            runfiles.write_bytes_atomic(local, data)
            copied.append(name)
        for name in self.appended:
            local = self.local_dir / name
            have = local.stat().st_size if local.exists() else 0
            pieces = appended_pieces(self.storage, self._k(name))
            if sum(piece.size for piece in pieces) > have:
                data = b"".join(_fetch(self.storage, pieces))
                if len(data) > have:
                    runfiles.write_bytes_atomic(local, data)
                    copied.append(name)
        return copied

    # ------------------------------------------------------------------ the thread
    def _k(self, name: str) -> str:
        return f"{self.key}/{name}"

    def _part_key(self, name: str, start: int, end: int) -> str:
        return f"{parts_key(self._k(name))}/c{self.incarnation}/{start:016d}-{end:016d}"

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._done < self._asked, self.interval_s)
                if self._closed:
                    return
                target, force = self._asked, self._forced > self._done
                puts, self._puts = list(self._puts), {}
            ok = self._pass(puts, force)
            with self._cond:
                if ok:
                    if not self._fenced:
                        self._error, self._said = "", set()
                        self._synced_at = time.monotonic()
                    self._done = max(self._done, target)
                    self._cond.notify_all()
            if not ok:
                time.sleep(self.interval_s)  # a failing store is asked again, not hammered

    def _pass(self, puts: list[str], force: bool) -> bool:
        """One round: the start marks (first pass), the puts, and the appended files' due parts (all
        of them when `force`). False when something failed (it is tried again)."""
        if self._fenced:
            return True
        ok = True
        for name in list(self._marks):
            ok &= self._attempt(f"mark where incarnation {self.incarnation} starts {name}", partial(self._mark, name))
        for name in puts:
            ok &= self._attempt(f"upload {name}", partial(self._upload, name), partial(self._puts.setdefault, name, None))
        for name in self.appended:
            ok &= self._attempt(f"upload new lines of {name}", partial(self._append, name, force))
        return ok

    def _attempt(self, what: str, action: Callable[[], None], again: Callable[[], object] | None = None) -> bool:
        """`action`; on a failure of the store, `again` (under the lock: puts it back) and False."""
        try:
            action()
            return True
        except (FileNotFoundError, _Fenced):
            return True  # the local file is not there (yet, or any more), or nothing may be written
        except Exception as err:  # noqa: BLE001 - any failure of the store is retried
            if again is not None:
                with self._cond:
                    again()
            self._say(f"storage: could not {what} to {self.storage.location(self.key)}: {first_line(err)} (retrying)")
            return False

    def _say(self, message: str) -> None:
        self._error = message
        if message not in self._said:
            self._said.add(message)
            try:
                self.on_error(message)
            except Exception:  # noqa: BLE001 - the report of a failure must not fail the mirror
                log.warning("%s", message)

    def _check_owner(self) -> None:
        """Before each write: raises `_Fenced` once the store names an incarnation newer than this one."""
        if not self._fenced:
            owner = fencing.newest(self.storage, claims_key(self.key))
            if owner <= self.incarnation:
                return
            with self._cond:
                self._fenced = True
                self._cond.notify_all()
            self._say(f"storage: incarnation {owner} of this run now owns {self.storage.location(self.key)}; "
                      f"this incarnation ({self.incarnation}) stopped writing to it")
        raise _Fenced

    def _mark(self, name: str) -> None:
        self._check_owner()
        offset = self._offsets.get(name, 0)
        self.storage.write(self._part_key(name, offset, offset), b"")
        self._marks.remove(name)

    def _upload(self, name: str) -> None:
        data = (self.local_dir / name).read_bytes()
        self._check_owner()
        self.storage.write(self._k(name), data)
        self.uploaded_bytes += len(data)

    def _append(self, name: str, force: bool = False) -> None:
        """The complete lines appended to `name` since its last part, as new parts when due (or `force`)."""
        local = self.local_dir / name
        size, offset = local.stat().st_size, self._offsets.get(name, 0)
        now = time.monotonic()
        if size <= offset or not (force or size - offset >= self.part_bytes
                                  or now - self._last_part.get(name, -math.inf) >= self.max_lag_s):
            return
        with open(local, "rb") as src:
            while offset < size:
                data = _complete_lines(src, offset, size, self.part_bytes)
                if not data:
                    break  # a line still being written
                self._check_owner()
                self.storage.write(self._part_key(name, offset, offset + len(data)), data)
                offset += len(data)
                self._offsets[name], self._last_part[name] = offset, now
                self.uploaded_bytes += len(data)
