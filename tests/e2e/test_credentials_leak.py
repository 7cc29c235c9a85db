"""Storage keys never land where another process can read them. Two `run`s from the command line (a BSP
job, whose coordinator reads the store, and an ASP job, whose parameter server writes its snapshots
there too) against a local S3 (moto) with fake keys in the storage URI of their config files; then every
file under Ray's session folder (its logs: the runtime-env agent's, the workers', the GCS's), the run
folders, every object of the bucket and both commands' output are searched for either key, and Ray's KV
store is searched once the jobs have ended. The mechanism is Ray's and the OS's (what Ray writes to its
logs), so the jobs are real ones on the test session's Ray."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from actors.runs.storage import open_storage

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the test extra)")
REPO = Path(__file__).resolve().parents[2]
ACCESS_KEY, SECRET_KEY = "AKIAFAKEKEYLEAKTEST42", "FAKESECRETVALUE-never-written-0193"
KEYS = (ACCESS_KEY.encode(), SECRET_KEY.encode())


def config(name: str, uri: str, **over) -> dict:
    return {"name": name, "seed": 0, "workers": {"count": 2, "min": 1, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 16},
            "optimizer": {"name": "sgd", "lr": 0.05}, "storage": uri, "checkpoint": {"every_steps": 10},
            "stop": {"max_steps": 30}, "eval_every": 0, **over}


def leaks_in(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                found += [f"{path}: {key.decode()}" for key in KEYS if key in data]
        except OSError:
            continue  # a socket, a file gone meanwhile
    return found


def test_storage_keys_in_the_uri_are_in_no_log_file_object_or_output(tmp_path, run_root, s3):
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    from actors.runs.runfiles import KV_NAMESPACE

    uri = s3.format(prefix="leak") + f"&access_key={ACCESS_KEY}&secret_key={SECRET_KEY}"
    address = ray.get_runtime_context().gcs_address
    outputs, run_dirs = [], []
    for name, over in (("leak-bsp", {}), ("leak-asp", {"sync": {"policy": "asp"}, "server": {"snapshot_every": 10}})):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config(name, uri, **over)))
        done = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(path), "--address", address],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        print(done.stdout[-2000:], done.stderr[-2000:])
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout + done.stderr)
        run_dirs += [p for p in (run_root / name).iterdir() if p.is_dir()]
    assert len(run_dirs) == 2, run_dirs

    leaks = [f"output: {key.decode()}" for out in outputs for key in KEYS if key.decode() in out]
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    leaks += leaks_in(session)
    for run_dir in run_dirs:
        leaks += leaks_in(run_dir)
    bucket = open_storage(s3.format(prefix="leak"))
    objects = [key for key, size in bucket.list("") if size >= 0]
    assert any(key.startswith("leak-asp/") and "/server/" in key for key in objects), \
        f"the ASP job's server stored no snapshot (it could not open the store): {objects}"
    for key in objects:
        data = bucket.read(key)
        leaks += [f"bucket {key}: {k.decode()}" for k in KEYS if k in data]
        if key.endswith("coordinator.json") and json.loads(data).get("secret"):
            leaks.append(f"bucket {key}: the rendezvous signing key")  # it stays on the node and in Ray's KV
    leaks += [f"{d / 'coordinator.json'}: the rendezvous signing key (the mirror uploads the state file)"
              for d in run_dirs if json.loads((d / "coordinator.json").read_text()).get("secret")]
    for key in _internal_kv_list("", namespace=KV_NAMESPACE):
        value = _internal_kv_get(key, namespace=KV_NAMESPACE) or b""
        leaks += [f"Ray KV {key!r} after the jobs ended: {k.decode()}" for k in KEYS
                  if k in value or k.hex().encode() in value]
    assert not leaks, "\n".join(leaks)
    kept = list(_internal_kv_list("secret/leak-", namespace=KV_NAMESPACE))
    assert not kept and not any((d / "secret.key").exists() for d in run_dirs), \
        f"the runs' secrets outlived them: {kept}, {[d for d in run_dirs if (d / 'secret.key').exists()]}"
