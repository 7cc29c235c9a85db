"""How long ZipLine takes to place one barrier, for n workers and lookahead r.

Random last end times in [0, 1) and intervals in [0.05, 0.5) (seeded); one warm-up call, then the
median (and min, max) of `--runs` timed calls of `place_barrier`.

    python benchmarks/zipline.py [--workers 1024] [--lookahead 64] [--runs 5]

Prints one line per size, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from algorithms.rules.zipline import place_barrier


def time_one(n: int, r: int, runs: int) -> dict:
    rng = np.random.default_rng(0)
    last_end, interval = rng.uniform(0, 1, n), rng.uniform(0.05, 0.5, n)
    place_barrier(last_end, interval, r)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        place_barrier(last_end, interval, r)
        times.append((time.perf_counter() - started) * 1000)
    return {"workers": n, "lookahead": r, "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--lookahead", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows = [time_one(n, r, args.runs) for n, r in ((4, 16), (64, 64), (args.workers, args.lookahead))]
    for row in rows:
        print(f"n={row['workers']:<5} r={row['lookahead']:<4} median {row['median_ms']:8.2f} ms "
              f"[{row['min_ms']:.2f}-{row['max_ms']:.2f}] over {args.runs} runs after a warm-up")
    print(json.dumps({"benchmark": "zipline", "runs": args.runs, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
