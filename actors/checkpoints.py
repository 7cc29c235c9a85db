"""Checkpoints: atomic, verified, found again by `--resume`, on a local disk or an object store.

A checkpoint is two objects in `<run>/checkpoints/`: `step-NNNNNNNN.pt` (torch.save of the training
state) and its manifest `step-NNNNNNNN.json` (step, size, sha256), each written whole (a local file
with temp + fsync + rename, an object with one upload; actors/storage.py). The manifest goes last
and is deleted first, so a checkpoint counts only once its manifest exists and its bytes match it:
an object store has no rename, and a torn or partial upload of the data is simply a checkpoint
whose bytes do not match. `newest_valid` walks every run of a job, newest first, and skips any such
checkpoint with a warning. Checkpoints are for whole-job restarts; single-worker churn never touches
storage.

`where` is a `(Storage, key)` pair (the folder's key under the storage's root), or a local folder.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from actors.storage import Storage, open_storage

Where = tuple | Path | str


@dataclass(frozen=True)
class CheckpointRef:
    location: str
    """The data object: a local path, or a URI (storage root without its options, then the key)."""
    step: int
    run_id: str

    @property
    def path(self) -> Path:
        """The local path (meaningful for a local storage only)."""
        return Path(self.location)


def place(where: Where) -> tuple[Storage, str]:
    if isinstance(where, tuple):
        return where
    return open_storage(str(where)), ""


def _join(key: str, name: str) -> str:
    return f"{key.strip('/')}/{name}" if key.strip("/") else name


def save(where: Where, step: int, blob: bytes, keep: int, run_id: str = "") -> str:
    """Data, then its manifest; then the oldest beyond `keep` (manifest first). Returns the data's location."""
    storage, key = place(where)
    folder = _join(key, "checkpoints")
    data_key = _join(folder, f"step-{step:08d}.pt")
    storage.write(data_key, blob)
    storage.write(data_key[:-3] + ".json", json.dumps({
        "step": step, "file": data_key.rsplit("/", 1)[1], "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
        "time": time.time(), "run_id": run_id or Path(storage.path(key)).name}, indent=1).encode() + b"\n")
    manifests = sorted(k for k, _ in storage.list(folder) if re.fullmatch(r"step-\d+\.json", k.rsplit("/", 1)[1]))
    for old in manifests[:-keep] if keep > 0 else []:
        storage.delete(old)
        storage.delete(old[:-5] + ".pt")
    return storage.location(data_key)


def _manifest(storage: Storage, manifest_key: str) -> dict | None:
    try:
        manifest = json.loads(storage.read(manifest_key))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def verify(where: Where, manifest_key: str = "") -> str | None:
    """None when the checkpoint is whole, else why it is not. `where`: a manifest's local path, or a
    storage with the manifest's key."""
    if not isinstance(where, tuple):
        path = Path(where)
        storage, manifest_key = open_storage(str(path.parent)), path.name
    else:
        storage = where[0]
    manifest = _manifest(storage, manifest_key)
    if manifest is None or "sha256" not in manifest:
        return "unreadable manifest"
    data_key = _join(manifest_key.rsplit("/", 1)[0] if "/" in manifest_key else "", manifest.get("file", ""))
    try:
        data = storage.read(data_key)
    except OSError as err:
        return f"cannot read {manifest.get('file')}: {getattr(err, 'strerror', None) or err}"
    if len(data) != manifest.get("bytes"):
        return f"{manifest.get('file')} has {len(data)} bytes, manifest says {manifest.get('bytes')}"
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        return f"{manifest.get('file')} does not match its sha256"
    return None


def read_verified(storage: Storage, location: str) -> bytes:
    """A checkpoint's bytes by its data location, once its manifest checks out; RuntimeError with the
    problem otherwise."""
    key = storage.key_of(location)
    problem = verify((storage, ""), key[:-3] + ".json") if key.endswith(".pt") else "not a checkpoint (.pt)"
    if problem:
        raise RuntimeError(problem)
    return storage.read(key)


def newest_valid_of_job(job_root: Where, server: bool, warn: Callable[[str], None] = print) -> CheckpointRef | None:
    """What `--resume` continues from: the newest valid checkpoint; for a server policy, also its
    parameter server's snapshots (a run killed as a whole leaves those, written every
    `server.snapshot_every` versions)."""
    refs = [newest_valid(job_root, warn)]
    if server:
        refs.append(newest_valid(job_root, warn, pattern="*/server/checkpoints/step-*.json"))
    refs = [r for r in refs if r is not None]
    return max(refs, key=lambda r: r.step) if refs else None


def newest_valid(job_root: Where, warn: Callable[[str], None] = print,
                 pattern: str = "*/checkpoints/step-*.json") -> CheckpointRef | None:
    """The newest whole checkpoint over all runs of a job (by step, then by write time); `pattern`
    (a `*` matches within one folder name) under `job_root` picks other folders (a parameter
    server's snapshots in one run directory)."""
    storage, key = place(job_root)
    regex = re.compile("[^/]*".join(re.escape(p) for p in pattern.split("*")))
    prefix = key.strip("/") + "/" if key.strip("/") else ""
    manifests = []
    for found, _ in storage.list(key):
        rel = found[len(prefix):]
        if regex.fullmatch(rel):
            info = _manifest(storage, found) or {}
            manifests.append((int(info.get("step", -1)), float(info.get("time", 0.0)), found, rel))
    for step, _, found, rel in sorted(manifests, reverse=True):
        problem = verify((storage, ""), found)
        data = storage.location(found[:-5] + ".pt")
        if problem is None:
            return CheckpointRef(data, step, rel.split("/")[0] if "/" in pattern else "")
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
