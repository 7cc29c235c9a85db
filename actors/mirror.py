"""A run's copy on remote storage, kept up to date from its local working folder by a thread.

With `storage:` an object store, the coordinator (and the parameter server) still write the run's
files to a local folder as before: appends, fsync and rename are cheap there, and the event loop
never waits on a network. A `RunMirror` copies them to `<storage>/<job>/<run id>/`:

- a whole file (`coordinator.json`, `model.pt`, `status.json`, ...) when `put` names it: the newest
  content wins (puts that arrive while one uploads are coalesced, as the state file's writer does);
- an appended file (`history.jsonl`, `events.jsonl`, `step_times.jsonl`) once a second, as a new
  part `<name>.parts/<start>-<end>` holding the bytes since the last part; every `COMPACT_AFTER`
  parts, one part from 0 replaces them (a restart reads a few objects, not thousands). A reader
  (`read_appended`) takes the parts in order and skips what an earlier part already covered.

`hydrate()` is the other way: a coordinator that Ray restarted on another node finds an empty
local folder, and first copies down what the store has (the state file, history, events), so that
it carries on from there as a restart on the same node does.

Upload failures never reach the caller: they are retried every `interval_s`, and `on_error` hears
each new one once (the coordinator makes it an event).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from actors import runfiles
from actors.storage import Storage, first_line

log = logging.getLogger(__name__)

APPENDED = ("history.jsonl", "events.jsonl", "step_times.jsonl")
WHOLE = ("coordinator.json", "faults_fired.json", "config.yaml", "coordinator_faults_fired.json")
"""What a restarted coordinator reads back (hydrate), besides the appended files."""
COMPACT_AFTER = 64
"""Parts of one appended file before they are rewritten as one."""


def parts_key(name: str) -> str:
    return f"{name}.parts"


def _span(key: str) -> tuple[int, int] | None:
    try:
        start, end = key.rsplit("/", 1)[1].split("-")
        return int(start), int(end)
    except ValueError:
        return None


def appended_parts(storage: Storage, key: str) -> list[tuple[int, int, str]]:
    """(start, end, part key) of an appended file's parts, by start then by length (longest first)."""
    spans = []
    for part, _ in storage.list(parts_key(key)):
        span = _span(part)
        if span is not None:
            spans.append((span[0], -span[1], part))
    return [(s, -e, k) for s, e, k in sorted(spans)]


def read_appended(storage: Storage, key: str) -> bytes:
    """An appended file's bytes as mirrored: its parts in order, each byte once. A missing part ends
    it there (the bytes after a hole are not trusted)."""
    out = bytearray()
    for start, end, part in appended_parts(storage, key):
        if end <= len(out):
            continue  # covered by a compacted part
        if start > len(out):
            log.warning("%s: a hole at byte %d (the next part starts at %d); read up to it",
                        storage.location(key), len(out), start)
            break
        try:
            data = storage.read(part)
        except FileNotFoundError:  # compacted away meanwhile: the compacted part was listed before it
            continue
        out += data[len(out) - start:]
    return bytes(out)


class RunMirror:
    """Copies one local run folder to `storage` under `key` (`<job>/<run id>`)."""

    def __init__(self, storage: Storage, key: str, local_dir: Path, appended: tuple[str, ...] = APPENDED,
                 interval_s: float = 1.0, on_error: Callable[[str], None] | None = None) -> None:
        self.storage, self.key, self.local_dir = storage, key.strip("/"), Path(local_dir)
        self.appended = appended
        self.interval_s = interval_s
        self.on_error = on_error or (lambda message: log.warning("%s", message))
        self._cond = threading.Condition()
        self._puts: dict[str, None] = {}  # ordered set of names to upload whole
        self._offsets: dict[str, int] = {}
        self._parts: dict[str, int] = {}
        self._asked = 0
        self._done = 0
        self._error = ""
        self._closed = False
        self.uploaded_bytes = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the caller's side
    def start(self) -> RunMirror:
        """Begin mirroring: what the store already holds of each appended file is not sent again."""
        for name in self.appended:
            parts = appended_parts(self.storage, self._k(name))
            self._offsets[name] = max((end for _, end, _ in parts), default=0)
            self._parts[name] = len(parts)
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
        """Wait until every put and append so far is in the store; False on timeout."""
        with self._cond:
            self._asked += 1
            wanted = self._asked
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._done >= wanted or self._closed, timeout)

    @property
    def error(self) -> str:
        """The newest upload failure, "" once a pass succeeds."""
        return self._error

    def close(self, timeout: float = 30.0) -> bool:
        """Flush, then stop the thread. False when something could not be uploaded in time."""
        ok = self.flush(timeout) if self._thread is not None else True
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
            data = read_appended(self.storage, self._k(name))
            if len(data) > have:
                runfiles.write_bytes_atomic(local, data)
                copied.append(name)
        return copied

    # ------------------------------------------------------------------ the thread
    def _k(self, name: str) -> str:
        return f"{self.key}/{name}"

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._done < self._asked, self.interval_s)
                if self._closed:
                    return
                target = self._asked
                puts, self._puts = list(self._puts), {}
            ok = True
            for name in puts:
                ok &= self._attempt(f"upload {name}", lambda n=name: self._upload(n),
                                    lambda n=name: self._puts.setdefault(n, None))
            for name in self.appended:
                ok &= self._attempt(f"upload new lines of {name}", lambda n=name: self._append(n), lambda: None)
            with self._cond:
                if ok:
                    self._error = ""
                    self._done = max(self._done, target)
                    self._cond.notify_all()
            if not ok:
                time.sleep(self.interval_s)  # a failing store is asked again, not hammered

    def _attempt(self, what: str, action: Callable[[], None], again: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except FileNotFoundError:
            return True  # the local file is not there (yet, or any more): nothing to upload
        except Exception as err:  # noqa: BLE001 - any failure of the store is retried
            with self._cond:
                again()
            message = f"storage: could not {what} to {self.storage.location(self.key)}: {first_line(err)} (retrying)"
            if message != self._error:
                self._error = message
                try:
                    self.on_error(message)
                except Exception:  # noqa: BLE001 - the report of a failure must not fail the mirror
                    log.warning("%s", message)
            return False

    def _upload(self, name: str) -> None:
        data = (self.local_dir / name).read_bytes()
        self.storage.write(self._k(name), data)
        self.uploaded_bytes += len(data)

    def _append(self, name: str) -> None:
        local = self.local_dir / name
        if not local.exists():
            return
        size, offset = local.stat().st_size, self._offsets.get(name, 0)
        if size <= offset:
            return
        with open(local, "rb") as src:
            if self._parts.get(name, 0) >= COMPACT_AFTER:  # one part from 0 replaces the others
                data = src.read(size)
                self.storage.write(f"{parts_key(self._k(name))}/{0:016d}-{len(data):016d}", data)
                for start, end, part in appended_parts(self.storage, self._k(name)):
                    if (start, end) != (0, len(data)):
                        self.storage.delete(part)
                self._parts[name], end = 1, len(data)
            else:
                src.seek(offset)
                data = src.read(size - offset)
                self.storage.write(f"{parts_key(self._k(name))}/{offset:016d}-{offset + len(data):016d}", data)
                self._parts[name], end = self._parts.get(name, 0) + 1, offset + len(data)
        self._offsets[name] = end
        self.uploaded_bytes += len(data)
