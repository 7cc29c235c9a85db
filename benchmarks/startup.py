"""A job's start-up with signed rendezvous values (the default) against unsigned ones.

Each job (digits MLP, `--workers` workers, BSP) is started on one shared local Ray and timed from
`start()` to its first committed step (the first history record's time), which covers the
coordinator, the workers' start, the first group's formation and the first step. Signed and unsigned
jobs alternate, so the machine's drift falls on both alike; medians over `--pairs` pairs.

    python benchmarks/startup.py [--pairs 5] [--workers 3]

Prints one line per job, then a JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def one_job(signed: bool, workers: int, index: int) -> float:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    cfg = config_from_dict({
        "name": f"bench-startup-{index}", "seed": 0, "workers": {"count": workers, "cpus": 1},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 16},
        "comm": {"sign_rendezvous": signed}, "stop": {"max_steps": 5}, "eval_every": 0})
    started = time.time()
    job = ElasticJob(cfg).start()
    result = job.wait(timeout=300)
    if result.state != "FINISHED":
        raise RuntimeError(f"job {index} ended {result.state}: {result.cause}")
    first = min(r["time"] for r in job.history())
    return first - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    ensure_token_env()
    ray.init(address="local", num_cpus=max(8, args.workers + 2), namespace=NAMESPACE, log_to_driver=False, include_dashboard=False,
             logging_level="ERROR")
    one_job(True, args.workers, -1)  # warm-up: the first job pays imports and Ray's worker pool
    times: dict[str, list[float]] = {"signed": [], "unsigned": []}
    for pair in range(args.pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for signed in order:
            seconds = one_job(signed, args.workers, 2 * pair + int(signed))
            times["signed" if signed else "unsigned"].append(seconds)
            print(f"pair {pair}: {'signed' if signed else 'unsigned'} {seconds:.3f} s to the first committed step",
                  flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["signed"] / medians["unsigned"]
    print(f"median to the first committed step: signed {medians['signed']:.3f} s, unsigned {medians['unsigned']:.3f} s, "
          f"ratio {ratio:.3f}")
    print(json.dumps({"workers": args.workers, "pairs": args.pairs, "times": times, "medians": medians,
                      "ratio": ratio}))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
