"""Recovery from a worker death while a checkpoint upload to S3 is in flight, against the same death
with none in flight, in one job.

An S3 server (moto, in this process) listens on its own loopback address, and the traffic to it is
shaped with `tc` (htb, `--mbit`), as a store across a network would be: a checkpoint of the job's
model (`--hidden`: the width of the digits MLP with one hidden layer; about 600 bytes a unit with momentum) takes seconds to
upload. BSP, `--workers` workers, a checkpoint every `--every` steps to `s3://`. Kills alternate:
- *in flight*: a worker is SIGKILLed two steps after a checkpoint step (the upload has begun; the
  checkpoint's event, written when the upload ends, comes after the kill: checked, else the kill
  does not count);
- *idle*: a worker is SIGKILLed ten steps before a checkpoint step, the previous checkpoint's upload
  long done (checked too).
Each: death -> the survivors' next committed step, from history (as benchmarks/recovery.py). The
victims rotate over the ranks but rank 0 (it hands the checkpoint over; its death is the other
benchmark's). Medians; the ratio in-flight / idle.

    python benchmarks/storage_recovery.py [--events 5] [--workers 3] [--hidden 16384] [--every 250] [--mbit 40]

Needs root for `tc` (without it, `--mbit 0` runs unshaped and says so). Restores `lo` as it was.
Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testkit.harness import wait_until  # noqa: E402

STORE_ADDRESS = "127.78.0.2"
"""The S3 server's own loopback address (not 127.0.0.x: only its traffic is shaped)."""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Shaped:
    """htb on `lo` for the traffic to `address` at `mbit`, when `lo` has no root qdisc of its own (the
    lab's, or anyone's, is left alone: then this refuses)."""

    def __init__(self, address: str, mbit: float) -> None:
        self.address, self.mbit, self.on = address, mbit, False

    def __enter__(self) -> Shaped:
        if self.mbit <= 0:
            return self
        root = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        if "htb" in root or "root" in root and "noqueue" not in root:
            raise SystemExit(f"lo already has a root qdisc ({root.strip()}); not touching it")
        rate = f"{self.mbit * 1000:.0f}kbit"
        for cmd in (["qdisc", "add", "dev", "lo", "root", "handle", "78:", "htb", "default", "0"],
                    ["class", "add", "dev", "lo", "parent", "78:", "classid", "78:1", "htb", "rate", rate, "ceil", rate,
                     "burst", "65536", "cburst", "65536", "quantum", "65536"],
                    ["filter", "add", "dev", "lo", "parent", "78:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "dst", f"{self.address}/32", "flowid", "78:1"]):
            out = subprocess.run(["tc", *cmd], capture_output=True, text=True)
            if out.returncode != 0:
                self.__exit__()
                raise SystemExit(f"tc {' '.join(cmd)}: {out.stderr.strip()} (root needed; or --mbit 0)")
            self.on = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root", "handle", "78:"], capture_output=True)
            self.on = False


def start_store() -> tuple[object, str]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=STORE_ADDRESS, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    return server, f"s3://bench/runs?endpoint_override={endpoint}&scheme=http"


def run(events: int, workers: int, hidden: int, every: int, uri: str) -> dict:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    cfg = config_from_dict({
        "name": "bench-storage-recovery", "seed": 0, "storage": uri,
        "workers": {"count": workers, "cpus": 1, "failure_budget": 100},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": hidden, "depth": 1}, "batch_size": 16},
        "optimizer": {"lr": 0.01, "momentum": 0.9}, "checkpoint": {"every_steps": every, "keep": 2},
        "stop": {"max_steps": 10_000_000}, "eval_every": 0})
    job = ElasticJob(cfg).start()
    out: dict = {"in_flight": [], "idle": [], "skipped": []}
    try:
        wait_until(lambda: job.status().step > every + 5, 300, "the first checkpoint")
        for i in range(2 * events):
            kind = "in_flight" if i % 2 == 0 else "idle"
            step = job.status().step
            base = (step // every + 1) * every  # the next checkpoint step
            # in flight: two steps after a checkpoint step; idle: ten steps before one, the previous
            # checkpoint's upload long done (an interval is several upload times)
            target = base + 2 if kind == "in_flight" else base - 10
            checked = base if kind == "in_flight" else base - every
            wait_until(lambda: job.history()[-1]["step"] >= target, 300, f"step {target}")
            status = job.status()
            ranked = sorted((m for m in status.members if m.state == "training" and m.rank), key=lambda m: m.rank)
            victim = ranked[(i // 2) % len(ranked)]  # each kind kills every rank in turn
            last = job.history()[-1]
            epoch = last["membership_epoch"]
            killed_at = time.time()
            os.kill(victim.pid, signal.SIGKILL)
            first = wait_until(lambda: next((r for r in job.history() if r["time"] > killed_at
                                             and r["membership_epoch"] > epoch), None), 120, "survivors' next step")
            delay = first["time"] - killed_at
            saved = wait_until(lambda: next((e for e in job.events() if e["kind"] == "checkpoint"
                                             and e["detail"].get("step") == checked), None), 300, f"checkpoint {checked}")
            in_flight = saved["time"] > killed_at  # its upload ended after the kill
            if in_flight != (kind == "in_flight"):
                out["skipped"].append({"kind": kind, "upload_ended_after_kill_s": round(saved["time"] - killed_at, 3)})
                log(f"kill {i + 1}: meant {kind}, but the upload of {checked} {'was' if in_flight else 'was not'} in flight: not counted")
            else:
                out[kind].append(delay)
                log(f"kill {i + 1} ({kind}, rank {victim.rank}, step {last['step']}): next committed step after {delay:.3f}s; "
                    f"checkpoint {checked}'s upload ended {saved['time'] - killed_at:+.2f}s from the kill")
            wait_until(lambda: job.status().world_size == workers and job.status().state == "RUNNING", 180, "replacement")
            wait_until(lambda: job.status().step > target + 20, 120, "steady training after the replacement")
        uploads = [e for e in job.events() if e["kind"] == "checkpoint"]
        out["checkpoint_bytes"] = uploads[-1]["detail"].get("bytes") if uploads else None
    finally:
        job.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5, help="kills of each kind")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=16384, help="the MLP's width (the checkpoint's size)")
    parser.add_argument("--every", type=int, default=250, help="checkpoint interval (steps)")
    parser.add_argument("--mbit", type=float, default=40.0, help="the store's link (0: unshaped)")
    args = parser.parse_args()

    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="bench-runs-"))
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"), ("AWS_EC2_METADATA_DISABLED", "true")):
        os.environ.setdefault(name, value)  # before Ray starts: its actors inherit them
    ensure_token_env()
    server, uri = start_store()
    try:
        with Shaped(STORE_ADDRESS, args.mbit):
            ray.init(address="local", num_cpus=max(8, args.workers + 3), namespace=NAMESPACE, log_to_driver=False,
                     logging_level="ERROR")
            result = run(args.events, args.workers, args.hidden, args.every, uri)
            ray.shutdown()
    finally:
        server.stop()
    flight, idle = result["in_flight"], result["idle"]
    med_f = statistics.median(flight) if flight else None
    med_i = statistics.median(idle) if idle else None
    ratio = med_f / med_i if med_f and med_i else None
    size = result.get("checkpoint_bytes") or 0
    rows = [("checkpoint size (MB)", f"{size / 1e6:.1f}"),
            ("store link (Mbit/s)", f"{args.mbit:g}" if args.mbit > 0 else "unshaped"),
            ("upload time at that rate (s, estimate)", f"{size * 8 / (args.mbit * 1e6):.1f}" if args.mbit > 0 else "n/a"),
            ("death -> next step, upload in flight (s)",
             f"{med_f:.3f} [{min(flight):.3f}-{max(flight):.3f}] n={len(flight)}" if flight else "n/a"),
            ("death -> next step, no upload (s)", f"{med_i:.3f} [{min(idle):.3f}-{max(idle):.3f}] n={len(idle)}" if idle else "n/a"),
            ("ratio in flight / none (medians)", f"{ratio:.3f}" if ratio else "n/a"),
            ("kills not counted (upload state not as meant)", str(len(result["skipped"])))]
    print(f"{'metric (median [min-max])':<48}{'value':>34}")
    for label, value in rows:
        print(f"{label:<48}{value:>34}")
    print(json.dumps({"benchmark": "storage_recovery", "workers": args.workers, "hidden": args.hidden, "every": args.every,
                      "mbit": args.mbit, **result, "median_in_flight_s": med_f, "median_idle_s": med_i,
                      "ratio_in_flight_to_idle": ratio}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
