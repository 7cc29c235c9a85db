"""Degree and spectral gap of every topology, computed (not measured): pure numpy, instant.

    python benchmarks/topologies.py [--worlds 4 8 16]

Degree: the most other ranks one rank mixes with in one step. Gap: `spectral_gap`, i.e.
1 - |lambda_2(E[W])| for static and random topologies, and 1 - rho^(1/p) with rho = ||Pi W - J/n||_2
over one period p for time-varying ones ("per step" below). `aer` is shown with 1, 2 and 4 workers
per node (with 1 it is `one_peer_exp`). Prints a Markdown table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from algorithms.rules.topologies import TOPOLOGIES, Topology, degree, get_topology, spectral_gap


def cases() -> list[tuple[str, Topology]]:
    rows = [(kind, get_topology(kind)) for kind in TOPOLOGIES]
    return rows + [(f"aer (per_node={m})", get_topology("aer", per_node=m)) for m in (2, 4)]


def basis(topology: Topology) -> str:
    if topology.time_varying:
        return "period product, per step"
    return "E[W]" if topology.random else "W"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    worlds = parser.parse_args().worlds
    print("| topology | degree (n = " + ", ".join(map(str, worlds)) + ") | "
          + " | ".join(f"gap n={n}" for n in worlds) + " | gap of |")
    print("|---|---|" + "---|" * len(worlds) + "---|")
    report = []
    for label, topology in cases():
        degrees = [degree(topology, n) for n in worlds]
        gaps = [spectral_gap(topology, n) for n in worlds]
        print(f"| {label} | {', '.join(map(str, degrees))} | " + " | ".join(f"{g:.4f}" for g in gaps)
              + f" | {basis(topology)} |")
        report.append({"topology": label, "worlds": worlds, "degree": degrees, "gap": gaps})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
