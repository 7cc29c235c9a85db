"""Checkpoints: atomic, verified, found again by `--resume`, on a local disk or an object store.

A checkpoint is two objects in `<run>/checkpoints/`: the data `step-NNNNNNNN-<random>.pt` (torch.save
of the training state) and its manifest `step-NNNNNNNN.json` (step, the data's name, size, sha256,
time, run id, the workload's fingerprint), each written whole (a local file with temp + fsync +
rename, an object with one upload; actors/runs/storage.py). The manifest is the commit: it is written
after its data and names it, and a data object's name is never reused, so saving a step again (a
stop at a checkpoint step, a redo after a restore) cannot touch the checkpoint already committed for
it: a crash before the new manifest leaves the old one naming the old data. A checkpoint counts only
once its manifest exists and the data it names matches it (an object store has no rename: a torn
upload is a checkpoint whose bytes do not match). Each save then drops the oldest beyond `keep` (by
step number; manifest first) and deletes the data no manifest names (what a crash between the two
writes left, or what a newer save of the same step replaced).

`newest_valid` is what `--resume` continues from: the most recently written whole checkpoint over
every run of the job (the newest run's lineage: an older run that got further is not taken over a
newer one), skipping torn ones with a warning. `read_verified` reads a checkpoint's data once,
checks it against its manifest and returns those very bytes. Checkpoints are for whole-job restarts;
single-worker churn never touches storage.

`where` is a `(Storage, key)` pair (the folder's key under the storage's root), or a local folder.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors.runs.storage import Storage, open_storage

Where = tuple | Path | str
DATA = re.compile(r"step-(\d+)(?:-[0-9a-f]+)?\.pt")
"""A checkpoint's data object's name (older runs wrote `step-NNNNNNNN.pt`)."""
MANIFEST = re.compile(r"step-(\d+)\.json")


@dataclass(frozen=True)
class CheckpointRef:
    location: str
    """The data object: a local path, or a URI (storage root without its options, then the key)."""
    step: int
    run_id: str
    fingerprint: str | None = None
    """The workload's fingerprint the checkpoint was written with (None: written before they were kept)."""
    workload: str = ""
    """The workload it was written with, as a person reads it (the factory and its params)."""
    written: float = 0.0
    """When its manifest was written (time.time())."""

    @property
    def path(self) -> Path:
        """The local path (meaningful for a local storage only)."""
        return Path(self.location)


def fingerprint(factory: str, params: dict) -> tuple[str, str]:
    """(fingerprint, description) of a workload: its factory and params decide the model's tensors, so
    a checkpoint is resumed only by a config with the same ones (the optimizer's rate, the policy, the
    world size may change)."""
    described = json.dumps({"factory": factory, "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:16], described


def place(where: Where) -> tuple[Storage, str]:
    if isinstance(where, tuple):
        return where
    return open_storage(str(where)), ""


def _join(key: str, name: str) -> str:
    return f"{key.strip('/')}/{name}" if key.strip("/") else name


def _base(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _folder(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else ""


def manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


def save(where: Where, step: int, blob: bytes, keep: int, run_id: str = "", fingerprint: str | None = None,
         workload: str = "") -> str:
    """Data under a new name, then its manifest (the commit); then the oldest beyond `keep` (manifest
    first) and the data no manifest names. Returns the data's location."""
    storage, key = place(where)
    folder = _join(key, "checkpoints")
    name = f"step-{step:08d}-{secrets.token_hex(4)}.pt"
    data_key = _join(folder, name)
    storage.write(data_key, blob)
    manifest = {"step": step, "file": name, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                "time": time.time(), "run_id": run_id or Path(storage.path(key)).name}
    if fingerprint:
        manifest.update(fingerprint=fingerprint, workload=workload)
    storage.write(_join(folder, manifest_name(step)), json.dumps(manifest, indent=1).encode() + b"\n")
    _collect(storage, folder, keep, step)
    return storage.location(data_key)


def _collect(storage: Storage, folder: str, keep: int, saved_step: int) -> None:
    """Retention by step number, then the data no kept manifest names, up to the step just saved (a
    save of a later step in flight elsewhere is never touched). One save at a time per folder."""
    listing = [k for k, _ in storage.list(folder)]
    manifests = sorted((int(m.group(1)), k) for k in listing if (m := MANIFEST.fullmatch(_base(k))))
    dropped = manifests[:-keep] if keep > 0 else []
    for _, old in dropped:
        storage.delete(old)
    named, unreadable = set(), set()
    for kept_step, kept in manifests[len(dropped):]:
        info = _manifest(storage, kept)
        if info is None:
            unreadable.add(kept_step)  # every data object of its step stays (a person may want to look)
        else:
            named.add(str(info.get("file", "")))
    for k in listing:
        m = DATA.fullmatch(_base(k))
        if m and int(m.group(1)) <= saved_step and int(m.group(1)) not in unreadable and _base(k) not in named:
            storage.delete(k)


def _manifest(storage: Storage, manifest_key: str) -> dict | None:
    try:
        manifest = json.loads(storage.read(manifest_key))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _checked(storage: Storage, manifest_key: str, manifest: dict | None = None) -> tuple[str | None, bytes, str]:
    """(problem or None, the data's bytes as read once, the data's key) of the checkpoint whose manifest
    is `manifest_key`."""
    manifest = manifest if manifest is not None else _manifest(storage, manifest_key)
    if manifest is None or "sha256" not in manifest:
        return "unreadable manifest", b"", ""
    name = str(manifest.get("file", ""))
    if not DATA.fullmatch(name):  # a plain name in the same folder, never a path
        return f"the manifest names no checkpoint data ({name!r})", b"", ""
    data_key = _join(_folder(manifest_key), name)
    try:
        data = storage.read(data_key)
    except OSError as err:
        return f"cannot read {name}: {getattr(err, 'strerror', None) or err}", b"", data_key
    if len(data) != manifest.get("bytes"):
        return f"{name} has {len(data)} bytes, manifest says {manifest.get('bytes')}", b"", data_key
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        return f"{name} does not match its sha256", b"", data_key
    return None, data, data_key


def verify(where: Where, manifest_key: str = "") -> str | None:
    """None when the checkpoint is whole, else why it is not. `where`: a manifest's local path, or a
    storage with the manifest's key."""
    if not isinstance(where, tuple):
        path = Path(where)
        storage, manifest_key = open_storage(str(path.parent)), path.name
    else:
        storage = where[0]
    return _checked(storage, manifest_key)[0]


def read_verified(storage: Storage, location: str) -> bytes:
    """A checkpoint's bytes by its data location, read once and checked against its step's manifest
    (when the step was saved again since, the data that manifest names now); RuntimeError with the
    problem otherwise."""
    key = storage.key_of(location)
    m = DATA.fullmatch(_base(key))
    if m is None:
        raise RuntimeError(f"not a checkpoint's data (step-N.pt): {location}")
    problem, data, _ = _checked(storage, _join(_folder(key), manifest_name(int(m.group(1)))))
    if problem:
        raise RuntimeError(problem)
    return data


def ref_of(storage: Storage, location: str) -> CheckpointRef:
    """One checkpoint named by its data's location (a path or a URI; a local path outside `storage` is
    read where it is), once its manifest checks out; RuntimeError with the problem otherwise."""
    location = str(location)
    try:
        key = storage.key_of(location)
    except RuntimeError:
        if storage.remote or "://" in location:
            raise RuntimeError(f"{location} is not under the job's storage {storage.location('')}") from None
        storage, key = open_storage(str(Path(location).parent)), Path(location).name
    m = DATA.fullmatch(_base(key))
    if m is None:
        raise RuntimeError(f"not a checkpoint's data file (step-N-....pt): {location}")
    manifest_key = _join(_folder(key), manifest_name(int(m.group(1))))
    info = _manifest(storage, manifest_key)
    problem, _, data_key = _checked(storage, manifest_key, info)
    if problem or info is None:
        raise RuntimeError(problem or "unreadable manifest")
    return CheckpointRef(storage.location(data_key), int(m.group(1)), str(info.get("run_id", "")),
                         info.get("fingerprint"), str(info.get("workload", "")), float(info.get("time", 0.0)))


def newest_valid_of_job(job_root: Where, server: bool, warn: Callable[[str], None] = print,
                        run_id: str = "") -> CheckpointRef | None:
    """What `--resume` continues from: the newest valid checkpoint (of run `run_id` when given); for a
    server policy, also its parameter server's snapshots (a run killed as a whole leaves those, written
    every `server.snapshot_every` versions)."""
    run = run_id or "*"
    refs = [newest_valid(job_root, warn, pattern=f"{run}/checkpoints/step-*.json")]
    if server:
        refs.append(newest_valid(job_root, warn, pattern=f"{run}/server/checkpoints/step-*.json"))
    found = [r for r in refs if r is not None]
    return max(found, key=lambda r: (r.written, r.step)) if found else None


def newest_valid(job_root: Where, warn: Callable[[str], None] = print,
                 pattern: str = "*/checkpoints/step-*.json") -> CheckpointRef | None:
    """The most recently written whole checkpoint over all runs of a job (by the manifest's time, then
    by step): the newest run's lineage. `pattern` (a `*` matches within one folder name) under
    `job_root` picks other folders (a parameter server's snapshots in one run directory)."""
    storage, key = place(job_root)
    regex = re.compile("[^/]*".join(re.escape(p) for p in pattern.split("*")))
    prefix = key.strip("/") + "/" if key.strip("/") else ""
    manifests = []
    for found, _ in storage.list(key):
        rel = found[len(prefix):]
        if regex.fullmatch(rel) and MANIFEST.fullmatch(_base(found)):
            info = _manifest(storage, found) or {}
            manifests.append((float(info.get("time", 0.0)), int(info.get("step", -1)), found, rel, info))
    for written, step, found, rel, info in sorted(manifests, key=lambda m: m[:2], reverse=True):
        problem, _, data_key = _checked(storage, found, info or None)
        data = storage.location(data_key or found[:-5] + ".pt")
        if problem is None:
            return CheckpointRef(data, step, rel.split("/")[0] if "/" in pattern else "",
                                 info.get("fingerprint"), str(info.get("workload", "")), written)
        warn(f"warning: skipping checkpoint {data}: {problem}")
    return None


def average_states(blobs: list[bytes]) -> bytes:
    """The state of the kinds whose replicas differ, as the final model and a checkpoint hold it: the
    floating-point model tensors averaged over the replicas that trained (step > 0, when any did);
    everything else (optimizer, step, ...) from the first, and the step the smallest (the job's step
    is the slowest member's)."""
    import io

    import torch

    states = [torch.load(io.BytesIO(b), weights_only=True, map_location="cpu") for b in blobs]
    trained = [s for s in states if int(s["step"]) > 0]
    states = trained or states  # a joiner that never received a state (step 0) would drag the average back
    first = states[0]
    for name, tensor in first["model"].items():
        if torch.is_floating_point(tensor):
            first["model"][name] = sum(s["model"][name].to(torch.float64) for s in states).div(len(states)).to(tensor.dtype)
    first["step"] = min(int(s["step"]) for s in states)
    first["replicas"] = len(states)
    buf = io.BytesIO()
    torch.save(first, buf)
    return buf.getvalue()
