"""A job on a node whose /dev/shm is Docker's default 64 MiB: its workers' shared-memory all-reduce cannot
reserve its bytes, so the group all-reduces through gloo, a `transport` event says why, and the job
finishes with every worker alive (actors/transport/shm.py).

The job runs in a mount namespace of its own with a 64 MiB tmpfs on /dev/shm, with a local Ray of its
own (Ray's object store then falls back to /tmp, as in such a container). The model is the digits MLP
with 2600 hidden units (26.5 MiB of float32 gradients): a group's slots are sized from the model, so
each of the 4 members reserves 2 x 26.5 MiB, which 64 MiB cannot hold; with the default 128 hidden
units (38 KB) the group fits and rightly uses shared memory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.harness import child_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount a 64 MiB /dev/shm in a mount namespace")
def test_a_4_worker_job_on_a_64_mib_dev_shm_finishes_on_gloo_and_says_why(tmp_path):
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"))
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, inside the namespace
    job = [sys.executable, "-m", "orchestrator", "run", "configs/digits_bsp.yaml", "--set", "name=small-dev-shm",
           "--set", "workers.count=4", "--set", "workers.min=4", "--set", "workload.params.hidden=2600", "--set", "sync.bucket_mb=25",
           "--set", "stop.max_steps=20", "--set", "stop.target=null", "--set", "eval_every=0"]
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
                           "small-dev-shm", *job], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINISHED: small-dev-shm" in proc.stdout and "at step 20" in proc.stdout
    events = [json.loads(line) for path in (tmp_path / "runs" / "small-dev-shm").glob("*/events.jsonl")
              for line in path.read_text().splitlines()]
    transport = [e for e in events if e["kind"] == "transport"]
    assert len(transport) == 1, events
    reason = transport[0]["reason"]
    assert "No space left on device: /dev/shm" in reason and "all-reduces through gloo" in reason
    assert transport[0]["detail"]["group"] in reason
    assert not [e for e in events if e["kind"] in ("reshape", "failure", "restart")], events  # no worker died
    assert {e["kind"] for e in events} <= {"transition", "transport", "info"}, events
