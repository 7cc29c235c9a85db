"""What `plan` prints and `auto`'s first event says: the ranked rows as a table, the one-line
recommendation (against BSP where BSP was a candidate), and one line on what the cluster probe measured."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from orchestrator.planning.cluster import rank_medians
from orchestrator.planning.ranking import Row


def describe_probe(cluster: dict) -> str:
    """One line: what the probe measured (for `plan` and `auto`'s event)."""
    medians = rank_medians(cluster)
    links = "; ".join(f"{cluster['nodes'][link['a']]}<->{cluster['nodes'][link['b']]} "
                      f"{link['bytes_per_s'] * 8 / 1e6:.0f} Mbit/s, {link['latency_s'] * 1e3:.2f} ms"
                      for link in cluster["links"]) or "none (every rank on one node)"
    return (f"measured on the cluster: {len(cluster['nodes'])} node(s), ranks on nodes {cluster['node_of_rank']}; "
            f"one step's compute {statistics.median(medians) * 1e3:.2f} ms (ranks {min(medians) * 1e3:.2f}-"
            f"{max(medians) * 1e3:.2f}) on {cluster['device']} with {cluster['threads']} thread(s); links: {links}")


def recommendation(rows: Sequence[Row]) -> str:
    """One line: the pick and why (against BSP when BSP was a candidate)."""
    best = rows[0]
    bsp = next((r for r in rows if r.candidate.label == "bsp"), None)
    if bsp is None or bsp is best:
        fastest = min(rows, key=lambda r: r.step_s)
        if best.to_target_s is not None:
            why = f"predicted {best.to_target_s:.1f} s to the target ({best.step_s * 1e3:.1f} ms/step)"
        else:
            why = f"predicted {best.step_s * 1e3:.1f} ms/step"
        if best.exact and fastest is not best:
            why += (f"; the exact policy: {fastest.candidate.label}'s {fastest.step_s * 1e3:.1f} ms/step is not "
                    f"enough of a lead ({fastest.note or 'within the evidence'})")
        return f"{best.candidate.label}: {why}"
    if best.to_target_s is not None:
        why = (f"predicted {best.to_target_s:.1f} s to the target ({best.step_s * 1e3:.1f} ms/step x "
               f"{best.factor:.2f} of BSP's steps) against BSP's {bsp.to_target_s:.1f} s")
    else:
        why = f"predicted {best.step_s * 1e3:.1f} ms/step against BSP's {bsp.step_s * 1e3:.1f} ms"
    return f"{best.candidate.label}: {why}"


def table(rows: Sequence[Row], factors: str) -> str:
    """The rows, one line each, then `factors` (`factors_line`: the convergence factors' source, or why
    none apply)."""
    lines = [f"{'policy':<28} {'ms/step':>9} {'MB/step':>9} {'steps/BSP':>10} {'s to target':>12}"]
    for r in rows:
        factor = f"{r.factor:.2f}" if r.factor is not None else "-"
        target = f"{r.to_target_s:.1f}" if r.to_target_s is not None else ("-" if r.exact else "unknown")
        lines.append(f"{r.candidate.label:<28} {r.step_s * 1e3:>9.2f} {r.bytes_per_step / 1e6:>9.3f} {factor:>10} {target:>12}")
    lines.append(factors)
    return "\n".join(lines)
