"""Disk checkpoints: atomic, verified, found again by `--resume`.

A checkpoint is two files in `<run dir>/checkpoints/`: `step-NNNNNNNN.pt` (torch.save of the
training state) and its manifest `step-NNNNNNNN.json` (step, size, sha256), each written with
temp file + fsync + rename; the manifest goes last, so a checkpoint without one never counts.
`newest_valid` walks every run of a job, newest first, and skips any checkpoint whose bytes do
not match its manifest (truncated, corrupted) with a warning. Checkpoints are for whole-job
restarts; single-worker churn never touches the disk.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from actors import runfiles


@dataclass(frozen=True)
class CheckpointRef:
    path: Path
    step: int
    run_id: str


def save(run_dir: Path, step: int, blob: bytes, keep: int) -> Path:
    folder = Path(run_dir) / "checkpoints"
    data_path = folder / f"step-{step:08d}.pt"
    runfiles.write_bytes_atomic(data_path, blob)
    runfiles.write_json_atomic(data_path.with_suffix(".json"), {
        "step": step, "file": data_path.name, "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(), "time": time.time(), "run_id": Path(run_dir).name})
    for old in sorted(folder.glob("step-*.json"))[:-keep]:
        old.with_suffix(".pt").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return data_path


def verify(manifest_path: Path) -> Optional[str]:
    """None when the checkpoint is whole, else why it is not."""
    manifest = runfiles.read_json(manifest_path)
    if not isinstance(manifest, dict) or "sha256" not in manifest:
        return "unreadable manifest"
    data_path = manifest_path.with_name(manifest.get("file", ""))
    try:
        data = data_path.read_bytes()
    except OSError as err:
        return f"cannot read {data_path.name}: {err.strerror}"
    if len(data) != manifest.get("bytes"):
        return f"{data_path.name} has {len(data)} bytes, manifest says {manifest.get('bytes')}"
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        return f"{data_path.name} does not match its sha256"
    return None


def newest_valid_of_job(job_root: Path, server: bool, warn: Callable[[str], None] = print) -> Optional[CheckpointRef]:
    """What `--resume` continues from: the newest valid checkpoint; for a server policy, also its
    parameter server's snapshots (a run killed as a whole leaves those, written every
    `server.snapshot_every` versions)."""
    refs = [newest_valid(job_root, warn)]
    if server:
        refs.append(newest_valid(job_root, warn, pattern="*/server/checkpoints/step-*.json"))
    refs = [r for r in refs if r is not None]
    return max(refs, key=lambda r: r.step) if refs else None


def newest_valid(job_root: Path, warn: Callable[[str], None] = print,
                 pattern: str = "*/checkpoints/step-*.json") -> Optional[CheckpointRef]:
    """The newest whole checkpoint over all runs of a job (by step, then by write time); `pattern`
    under `job_root` picks other folders (a parameter server's snapshots in one run directory)."""
    manifests = []
    for path in Path(job_root).glob(pattern):
        info = runfiles.read_json(path) or {}
        manifests.append((int(info.get("step", -1)), float(info.get("time", 0.0)), path))
    for step, _, path in sorted(manifests, reverse=True):
        problem = verify(path)
        if problem is None:
            return CheckpointRef(path.with_suffix(".pt"), step, path.relative_to(job_root).parts[0])
        warn(f"warning: skipping checkpoint {path.with_suffix('.pt')}: {problem}")
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
