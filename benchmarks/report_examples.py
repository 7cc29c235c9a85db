"""The run reports shown in the README, drawn from real runs on this machine: `bsp` through a kill and
a replacement's join and a straggler, `shadow` through a kill and a rejoin, `dpsgd` on a ring through
a kill mid-exchange and a rejoin. Each job draws its own `report.png` when it ends (tracking.report);
this copies them to docs/report-<policy>.png.

    python benchmarks/report_examples.py [--out docs]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.config import config_from_dict  # noqa: E402
from orchestrator.job import NAMESPACE, ElasticJob, ensure_token_env  # noqa: E402

BASE = {"seed": 4, "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 16},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 25,
        "tracking": {"report": True}}
JOBS = {
    "bsp": dict(BASE, name="report-bsp", workers={"count": 4, "cpus": 0.5}, stop={"max_steps": 400},
                faults={"kills": [{"slot": "w1", "step": 80, "at": "allreduce"}],
                        "stragglers": [{"slot": "w0", "delay_s": 0.02}, {"slot": "w3", "delay_s": 0.06}]}),
    "shadow": dict(BASE, name="report-shadow", workers={"count": 4, "cpus": 0.5}, stop={"max_steps": 120},
                   sync={"policy": "shadow", "method": "ma"},
                   faults={"kills": [{"slot": "w1", "step": 20}],
                           "stragglers": [{"slot": f"w{i}", "delay_s": 0.08 + 0.04 * (i == 2)} for i in range(4)]}),
    "dpsgd": dict(BASE, name="report-dpsgd", workers={"count": 4, "cpus": 0.5, "batch_mode": "keep_worker"},
                  stop={"max_steps": 200}, sync={"policy": "dpsgd", "topology": {"kind": "ring"}, "consensus_every": 5},
                  faults={"kills": [{"slot": "w1", "step": 30, "at": "allreduce"}],
                          "stragglers": [{"slot": f"w{i}", "delay_s": 0.05} for i in range(4)]}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs"))
    parser.add_argument("--only", default=None, help="one of " + ", ".join(JOBS))
    args = parser.parse_args()
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False,
             logging_level="ERROR")
    for policy, cfg in JOBS.items():
        if args.only and policy != args.only:
            continue
        job = ElasticJob(config_from_dict(cfg)).start()
        result = job.wait(timeout=600)
        png = Path(result.run_dir) / "report.png"
        target = Path(args.out) / f"report-{policy}.png"
        shutil.copyfile(png, target)
        print(f"{policy}: {result.state} at step {result.step}; {png} -> {target}", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
