"""The language model on the network lab: validation loss against wall-clock time for each policy that
trades synchronization for speed, at 100 Mbit/s and at 1 Gbit/s between two nodes.

Setting: 4 workers on 2 virtual nodes of the lab (w0, w1 on node 0; w2, w3 on node 1), gloo on CPU,
the link between the nodes shaped by the kernel (`tc` htb) at `100m` (100 Mbit/s, 1 ms modelled
one-way latency) or `1g` (1 Gbit/s, 0.2 ms); within a node, loopback. The workload: the byte-level
GPT of `orchestrator.workloads.lm` (tiny: 0.83M parameters, 3.3 MB of float32 gradients, 64-byte
context) on the standard library's source, per-worker batch 8, AdamW (lr 0.003, betas 0.9/0.95,
weight decay 0.01, constant rate), its real compute (four workers share 2 cores: no modelled sleep
unless `--compute-ms`). Held-out loss every 25 steps on 64 fixed windows. Each run stops at the
target loss, at `--max-steps` or after `--time-s` seconds, whichever comes first.

Policies (the planner's candidates by label): `bsp`, `bsp hierarchical`, `diloco h=16`,
`streaming_diloco h=16 f=4`, `dpsgd ring` (float32), `dpsgd ring uint8` and `shadow ma`; the
decentralized ones with `consensus_every: 0`. Per run: time per step, bytes per step, time (from the
start of training: the first record's time less its steps at the run's time per step; before 2026-11-29
from the first committed step) to the target held-out loss and to within 2% of it, steps to the target,
the loss curve. Per network: the medians over the seeds and each policy's time relative to BSP's; a PNG of
held-out loss against time, one panel per network (`--png`).

    python benchmarks/lm_lab.py [--networks 100m,1g] [--seeds 0,1,2] [--only bsp,diloco] [--target 2.3]
        [--max-steps 1500] [--time-s 300] [--out lm_lab.jsonl] [--resume] [--report] [--png docs/lm_lab.png]

Rows are appended to `--out` as each run ends (`--resume` skips those there). Needs root and `tc` (the
lab); exits 2 with the reason otherwise. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.tradeoffs import measured_rows  # noqa: E402
from orchestrator.calibration import TIMED_FROM_START, bytes_per_step, load, per_step, run_start  # noqa: E402
from orchestrator.lab_grid import NETWORKS, lab_ready  # noqa: E402

WORKERS = 4
LABELS = ("bsp", "bsp hierarchical", "diloco h=16", "streaming_diloco h=16 f=4", "dpsgd ring", "dpsgd ring uint8", "shadow ma")
EVAL_EVERY = 25


def job_dict(label: str, cand, network: str, args, seed: int, root: str) -> dict:
    mbit, latency = NETWORKS[network]
    sync = dict(cand.sync)
    if sync["policy"] in ("dpsgd", "dadam", "choco"):
        sync["consensus_every"] = 0
    name = "lmlab-" + "".join(ch if ch.isalnum() else "-" for ch in f"{label}-{network}-s{seed}")
    return {"name": name[:64], "seed": seed, "run_dir": root,
            "workers": {"count": WORKERS, "cpus": 0.5},
            "workload": {"factory": "orchestrator.workloads.lm:lab_gpt",
                         "params": {"size": "tiny", "compute_ms": args.compute_ms, "seed": seed}, "batch_size": 8},
            "optimizer": {"name": "adamw", "lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01},
            "sync": sync, "compression": dict(cand.compression) or {"codec": "none"},
            "network": {"nodes": 2, "workers_per_node": 2, "inter": {"mbit": mbit, "latency_ms": latency}},
            "stop": {"max_steps": args.max_steps, "time_s": args.time_s,
                     "target": {"metric": "eval_loss", "value": args.target, "mode": "min"}},
            "eval_every": EVAL_EVERY}


def run(label: str, cand, network: str, args, root: str, seed: int) -> dict:
    from orchestrator.config import config_from_dict
    from orchestrator.job import ElasticJob

    job = ElasticJob(config_from_dict(job_dict(label, cand, network, args, seed, root))).start()
    result = job.wait(timeout=args.time_s + 600)
    history = job.history()
    if not history:
        raise RuntimeError(f"{label} {network}: no history ({result.state}: {result.cause})")
    start = run_start(history)
    curve = sorted((round(r["time"] - start, 3), r["step"], r["metrics"]["eval_loss"]) for r in history
                   if (r.get("metrics") or {}).get("eval_loss") is not None)
    hit = next(((t, s) for t, s, v in curve if v <= args.target), (None, None))
    near = next((t for t, _, v in curve if v <= 1.02 * args.target), None)
    return {"policy": label, "network": network, "seed": seed, "state": result.state, "target": args.target,
            "step_s": per_step(history), "bytes_per_step": bytes_per_step(history),
            "to_target_s": hit[0], "timed_from": TIMED_FROM_START, "steps_to_target": hit[1], "to_within_2pct_s": near,
            "steps": max(r["step"] for r in history), "best_eval_loss": min((v for _, _, v in curve), default=None),
            "curve": curve}


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def majority_median(values: list) -> float | None:
    """The median of the values reached, where most runs reached one (None: most missed)."""
    reached = [v for v in values if v is not None]
    return statistics.median(reached) if 2 * len(reached) > len(values) else None


def report(rows: list[dict]) -> dict:
    summary: dict = {}
    networks = [n for n in NETWORKS if any(r["network"] == n for r in rows)]
    for network in networks:
        here = [r for r in rows if r["network"] == network]
        policies = list(dict.fromkeys(r["policy"] for r in here))
        cell = {}
        for p in policies:
            runs = [r for r in here if r["policy"] == p]
            reached = [r for r in runs if r["to_target_s"] is not None]
            missed = 2 * len(reached) <= len(runs)  # most seeds must reach it
            cell[p] = {"seeds": len(runs), "step_s": statistics.median(r["step_s"] for r in runs),
                       "bytes_per_step": statistics.median(r["bytes_per_step"] for r in runs),
                       "to_target_s": None if missed else median_or_none([r["to_target_s"] for r in reached]),
                       "steps_to_target": None if missed else median_or_none([r["steps_to_target"] for r in reached]),
                       "to_within_2pct_s": majority_median([r["to_within_2pct_s"] for r in runs]),
                       "best_eval_loss": median_or_none([r["best_eval_loss"] for r in runs])}
        bsp = cell.get("bsp", {}).get("to_target_s")
        print(f"\n== {network} (target held-out loss {here[0]['target']}; medians over seeds)")
        print(f"{'policy':<28}{'seeds':>6}{'ms/step':>9}{'MB/step':>9}{'to target s':>13}{'steps':>7}"
              f"{'vs bsp':>8}{'to 2% s':>9}{'2% vs bsp':>10}")
        for p, v in cell.items():
            v["vs_bsp"] = v["to_target_s"] / bsp if bsp and v["to_target_s"] else None
            v["within_2pct_vs_bsp"] = v["to_within_2pct_s"] / bsp if bsp and v["to_within_2pct_s"] else None
            fmt = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
            print(f"{p:<28}{v['seeds']:>6}{v['step_s'] * 1e3:>9.1f}{v['bytes_per_step'] / 1e6:>9.3f}"
                  f"{fmt(v['to_target_s'], '.1f') if v['to_target_s'] is not None else 'missed':>13}"
                  f"{fmt(v['steps_to_target'], '.0f'):>7}{fmt(v['vs_bsp'], '.2f'):>8}"
                  f"{fmt(v['to_within_2pct_s'], '.1f'):>9}{fmt(v['within_2pct_vs_bsp'], '.2f'):>10}")
        summary[network] = cell
    return {"benchmark": "lm_lab", "networks": summary}


def draw(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    networks = [n for n in NETWORKS if any(r["network"] == n for r in rows)]
    fig, axes = plt.subplots(1, len(networks), figsize=(7 * len(networks), 5), squeeze=False)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    for ax, network in zip(axes[0], networks):
        for r in rows:
            if r["network"] != network or not r["curve"]:
                continue
            t, _, v = zip(*r["curve"])
            first = not any(line.get_label() == r["policy"] for line in ax.get_lines())
            ax.plot(t, v, color=colors[r["policy"]], lw=1.2, alpha=0.85, label=r["policy"] if first else "_")
        ax.axhline(rows[0]["target"], color="gray", ls="--", lw=0.8, label="target")
        mbit = NETWORKS[network][0]
        ax.set_title(f"byte-level GPT (0.83M), 2 nodes x 2 workers, {mbit:g} Mbit/s between nodes")
        ax.set_xlabel("wall time from the start of training (s)")
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.set_ylim(top=min(3.2, ax.get_ylim()[1]))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


def measure(args, out: Path) -> int:
    import ray

    from orchestrator import lab, planner
    from orchestrator.config import config_from_dict
    from orchestrator.job import NAMESPACE, ensure_token_env

    if not lab_ready():
        return 2
    done = {(r["policy"], r["network"], r["seed"]) for r in load(out)} if args.resume else set()
    if not args.resume:
        out.write_text("")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    base = config_from_dict({"name": "x", "workers": {"count": WORKERS},
                             "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "network": {"nodes": 2, "workers_per_node": 2}})
    by_label = {c.label: c for c in planner.candidates(base)}
    missing = [label for label in LABELS if label not in by_label]
    if missing:
        print(f"error: the planner has no candidate {missing}", file=sys.stderr)
        return 2
    cands = [by_label[label] for label in LABELS if not only or label in only or by_label[label].sync["policy"] in only]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    ensure_token_env()
    ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False, logging_level="ERROR")
    root = tempfile.mkdtemp(prefix="lm-lab-")
    for network in [n.strip() for n in args.networks.split(",") if n.strip()]:
        net_cfg = config_from_dict(job_dict("bsp", cands[0], network, args, 0, root)).network
        with lab.Lab(net_cfg):
            for row in lab.probe(net_cfg):
                print(f"[{network}] link {row['a']}->{row['b']}: asked {row['asked_mbit'] or 'unshaped'} Mbit/s, "
                      f"measured {row['measured_mbit']:.0f}, rtt {row['rtt_ms']:.3f} ms", flush=True)
            for seed in seeds:
                for cand in cands:
                    if (cand.label, network, seed) in done:
                        continue
                    began = time.time()
                    row = run(cand.label, cand, network, args, root, seed)
                    with open(out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"[{network}, seed {seed}] {cand.label}: {row['state']}, {row['step_s'] * 1e3:.1f} ms/step, "
                          f"{row['bytes_per_step'] / 1e6:.2f} MB/step, to target {row['to_target_s']} s at step "
                          f"{row['steps_to_target']}, best {row['best_eval_loss']:.3f} ({time.time() - began:.0f} s)", flush=True)
    ray.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default="100m,1g")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--only", default="", help="comma-separated labels or policy names")
    parser.add_argument("--target", type=float, default=2.3, help="held-out loss (nats per byte)")
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--time-s", type=float, default=300.0)
    parser.add_argument("--compute-ms", type=float, default=0.0, help="modelled compute slept per step, beside the real one")
    parser.add_argument("--out", default="lm_lab.jsonl")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--report", action="store_true", help="only print the report from --out")
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    rows = measured_rows(args, Path(args.out), measure)
    if isinstance(rows, int):
        return rows
    summary = report(rows)
    if args.png:
        draw(rows, Path(args.png))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
