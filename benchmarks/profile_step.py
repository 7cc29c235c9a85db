"""Where rank 0's BSP step goes: py-spy on rank 0 of a running 2-worker job, grouped by phase.

The job is bsp_vs_ddp.py's (digits MLP, hidden 128, per-worker batch 32, SGD with momentum, 25 MiB
buckets, one torch thread per worker, the default engine). Once it has trained a while, py-spy
samples rank 0's process (`py-spy record -r RATE -d SECONDS -f raw --nonblocking`: it counts only
samples where a thread is not waiting). Each sample whose stack passes through
`StepRunner.train` (actors/training/step.py) goes to every phase its stack passes through (inclusive shares), so a phase
nested in another (the hooks' launches inside backward) counts in both.

    python benchmarks/profile_step.py [--seconds 10] [--rate 250] [--engine auto] [--workload digits|lm] [--raw out.txt]

Needs py-spy (`pip install py-spy`) and permission to read another process's memory (root, or
ptrace allowed). Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROJECT = ("actors/", "algorithms/", "core/", "orchestrator/job", "torch/")


def _below(*names: str):
    """A phase: the sample's stack below the step (`StepRunner.train`) passes through one of these functions."""
    return lambda frames: any(f.split(" (")[0].split(".")[-1] in names for f in frames)


def _user_code(frames: list[str]) -> bool:
    """The workload's own code (its loss, hence the forward), called by the step itself."""
    return bool(frames) and not any(part in frames[0] for part in PROJECT)


PHASES = [
    ("backward, including bucket launches (and, on the reducer, its C++ wait)", _below("backward")),
    ("the hooks' launches (Python engine: _launch_ready)", _below("_launch_ready")),
    ("waiting for the last bucket (finish_step, Handle.wait)", _below("finish_step")),
    ("forward and loss (the workload's code)", _user_code),
    ("the optimizer step (apply_update)", _below("apply_update")),
    ("the vote's tail (VoteDraft.tail)", _below("tail")),
    ("building the batch (micro_batches, _collate)", _below("micro_batches", "_collate")),
    ("begin_step", _below("begin_step")),
    ("per-step seeding (seed_step)", _below("seed_step")),
    ("commit and record (commit)", _below("commit")),
]


def is_step(frame: str) -> bool:
    """Whether a frame is the step's own function (`StepRunner.train` in actors/training/step.py)."""
    return frame.split(" (")[0].split(".")[-1] == "train" and "actors/training/step.py" in frame


def phase_shares(raw: str) -> tuple[int, int, dict[str, float]]:
    """From py-spy's raw output (`frame (file:line);... count` per line): (samples of the whole
    process, samples inside the step, each phase's share of the latter)."""
    total = inside = 0
    counts = dict.fromkeys((label for label, _ in PHASES), 0)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if is_step(f)), None)
        if at is None:
            continue
        inside += n
        below = frames[at + 1:]  # only what the step itself calls
        for label, within in PHASES:
            if within(below):
                counts[label] += n
    return total, inside, {label: (c / inside if inside else 0.0) for label, c in counts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument("--engine", default="auto", help="sync.engine: auto | reducer | python")
    parser.add_argument("--workload", default="digits", help="bsp_vs_ddp.py's workload: digits | lm")
    parser.add_argument("--raw", help="also keep py-spy's raw output here")
    args = parser.parse_args()
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2

    import ray

    from orchestrator.job import NAMESPACE, ElasticJob, ensure_token_env
    from testkit.ddp_pair import job_config
    from testkit.harness import wait_until

    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", tempfile.mkdtemp(prefix="bench-runs-"))
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    job = ElasticJob(job_config("profile-step", 10_000_000, args.engine, args.workload)).start()
    try:
        wait_until(lambda: job.status().step > 200, 120, "training")
        rank0 = next(m for m in job.status().members if m.rank == 0)
        if args.raw:
            out = args.raw
        else:  # mkstemp, not mktemp: the name is ours once returned
            fd, out = tempfile.mkstemp(suffix=".txt", prefix="profile-step-")
            os.close(fd)
        first = job.status().step
        began = time.time()
        subprocess.run([pyspy, "record", "-r", str(args.rate), "-d", str(args.seconds), "-f", "raw", "--nonblocking",
                        "-p", str(rank0.pid), "-o", out], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        span = time.time() - began
        steps = job.status().step - first
    finally:
        job.stop()
        ray.shutdown()
    total, inside, shares = phase_shares(Path(out).read_text())
    expected = args.rate * args.seconds  # samples of a thread that never waits
    print(f"{steps} steps in {span:.2f} s under the profiler; samples: {total} in the process, {inside} inside "
          f"the step (StepRunner.train); the training thread active {inside / expected:.0%} of the time "
          f"({1000 * inside / args.rate / max(steps, 1):.2f} ms per step)")
    print(f"{'where (inclusive share of the step)':<76}{'share':>8}")
    for label, share in shares.items():
        print(f"{label:<76}{share:>8.1%}")
    print(json.dumps({"benchmark": "profile_step", "engine": args.engine, "steps": steps, "seconds": span,
                      "samples_total": total, "samples_train_step": inside, "shares": shares}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
