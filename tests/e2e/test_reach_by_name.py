"""A local run reached by its name from another shell (orchestrator/local_runs.py): `status`, `scale` and
`stop` without `--address` while it runs on the local Ray it started, `status` after it ended (that Ray
gone with it), and `status --address` where no Ray answers failing in one line within its bound."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from actors.runs import runfiles
from testkit.harness import child_env, free_port, start_run, wait_until

REPO = Path(__file__).resolve().parents[2]
NAME = "by-name"


def _cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m orchestrator ARGS` from another shell: a process of its own, nothing exported."""
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"$ {' '.join(args)} -> {proc.returncode}\n{proc.stdout}{proc.stderr[-1500:]}")
    return proc


def test_a_local_run_is_reached_by_name_from_another_shell_and_after_it_ended(tmp_path):
    records = tmp_path / "records"
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"), ORCHESTRATOR_LOCAL_RUNS=str(records))
    env.pop("RAY_ADDRESS", None)  # the run starts a local Ray of its own, and the other shell knows no address
    output = tmp_path / "run.log"
    # slowed (a straggler) so that it trains on while the other shell looks; it ends only by `stop`. Its
    # workers' heartbeats get a minute: beside the suite's other process, a joiner's start has starved both
    # workers (Ray runs them at a lower priority) past the default 10 s, and hangs are not this test's matter.
    # Likewise the joiner gets a minute before it is said unplaced: on a loaded CI machine its process took
    # over 10 s to start while its CPU was already reserved, and `scale` reported "0 CPUs free"
    run = start_run(["configs/digits_bsp.yaml", "--set", f"name={NAME}", "--set", "workers.count=2",
                     "--set", "workers.max=3", "--set", "stop.max_steps=1000000", "--set", "stop.target=null",
                     "--set", "workers.heartbeat_s=60", "--set", "workers.pause_after_s=60",
                     "--set", "faults.stragglers=[{slot: w0, delay_s: 0.02}]"], REPO, env, output)
    try:
        wait_until(lambda: "[running] step" in output.read_text() or run.poll() is not None, timeout=180,
                   what="the run's first progress line")
        said = output.read_text()
        assert run.poll() is None, said
        address = re.search(r"^local Ray at (\S+): from another shell", said, re.M)
        assert address, said  # `run` names the address it started, in one line
        assert json.loads((records / f"{NAME}.json").read_text())["address"] == address.group(1)

        status = _cli("status", NAME, env=env)
        assert status.returncode == 0 and "RUNNING" in status.stdout and "world size 2" in status.stdout

        scale = _cli("scale", NAME, "3", env=env, timeout=300)
        assert scale.returncode == 0, scale.stderr
        run_dir = tmp_path / "runs" / NAME / re.search(r"^job \S+ run (\S+):", said, re.M).group(1)
        wait_until(lambda: any(e["kind"] == "reshape" and len(e["detail"].get("new_members", [])) == 3
                               for e in runfiles.read_jsonl(run_dir / "events.jsonl")), timeout=120,
                   what="the reshape to 3 workers")
        status = _cli("status", NAME, env=env)
        assert status.returncode == 0 and "world size 3" in status.stdout

        stop = _cli("stop", NAME, env=env)
        assert stop.returncode == 0 and f"{NAME}: STOPPED" in stop.stdout
        assert run.wait(timeout=120) == 3  # stopped from elsewhere; its local Ray ended with it
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert json.loads((records / f"{NAME}.json").read_text())["address"] is None  # dropped at the run's end

    after = _cli("status", NAME, env=env)  # no Ray holds it any more: its run folder's status.json answers
    assert after.returncode == 0 and "STOPPED" in after.stdout and "world size 3" in after.stdout

    nowhere = f"127.0.0.1:{free_port()}"
    began = time.monotonic()
    dead = _cli("status", NAME, "--address", nowhere, env=env, timeout=60)
    took = time.monotonic() - began
    assert dead.returncode == 1
    assert dead.stderr.startswith(f"error: no Ray at {nowhere} (nothing answered within 10s): ")
    assert dead.stderr.count("\n") == 1
    assert took < 15, f"status --address to no Ray took {took:.1f}s"
