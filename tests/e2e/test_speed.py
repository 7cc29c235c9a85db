"""The speed figures docs/benchmarks.md states, as gates (slow: each runs a benchmark's own sides).

BSP keeps torch DDP's pace at DDP's memory (`benchmarks/bsp_vs_ddp.py`'s sides, `testkit/ddp_pair.py`); a death costs the survivors
well under 0.1 s whichever rank dies, and no committed step; a spare makes a replacement and a
scale-up take under a second (`benchmarks/recovery.py`'s side, `testkit/recovery_side.py`). Timings on a 2-core machine are noisy:
each gate is on a median, and each bound is the figure the issue asked for, next to the measured one.
"""
from __future__ import annotations

import statistics

import pytest


@pytest.mark.slow
def test_bsp_keeps_ddp_pace_at_ddps_memory(ray_session):
    """docs/benchmarks.md: 1.88-3.84x DDP's steps/s (medians of 11 and 7 pairs), peak worker RSS 1.08-1.09x:
    on one node the workers all-reduce through shared memory (actors/transport/shm.py), DDP through
    gloo's TCP on loopback. The gate, 2x, fails if that path stops being taken (with gloo, 1.05-1.19x)."""
    from testkit.ddp_pair import run_ddp, run_orchestrator

    ratios, rss = [], []
    for i in range(5):  # alternating pairs, the ratio taken pair by pair
        orch, ddp = run_orchestrator(f"speed-bsp-{i}", 550, "digits"), run_ddp(550, "digits")
        ratios.append(orch["steps_per_s"] / ddp["steps_per_s"])
        rss.append(orch["rss_mib"] / ddp["rss_mib"])
        print(f"pair {i}: {orch['steps_per_s']:.1f} vs {ddp['steps_per_s']:.1f} steps/s, "
              f"RSS {orch['rss_mib']:.0f} vs {ddp['rss_mib']:.0f} MiB")
    print(f"steps/s ratio median {statistics.median(ratios):.3f}, RSS ratio median {statistics.median(rss):.3f}")
    assert statistics.median(ratios) >= 2.0, ratios
    assert statistics.median(rss) <= 1.2, rss


@pytest.mark.slow
def test_recovery_within_100ms_for_every_rank_and_a_spare_within_1s(ray_session):
    """docs/benchmarks.md: death -> the survivors' next committed step 17-37 ms median over the kills, 0
    steps lost; with a spare, the replacement's first step 0.14-0.24 s, and scale() -> the joiner's first
    committed step 0.06-0.09 s (0.254 s when the spare imported its adoption's modules at the adoption:
    the 0.2-s gate catches that)."""
    from testkit.recovery_side import orchestrator_side

    out = orchestrator_side(events=9, workers=3, every=50, spares=1)
    by_rank: dict[int, list[float]] = {}
    for rank, delay in zip(out["victim_ranks"], out["death_to_next_step_s"]):
        by_rank.setdefault(rank, []).append(delay)
    medians = {rank: statistics.median(d) for rank, d in sorted(by_rank.items())}
    print(f"death -> next step by rank: {by_rank}; medians {medians}; lost {out['steps_lost']}; "
          f"replacement {out['death_to_replacement_step_s']}; scale {out['scale_to_first_step_s']:.3f}s")
    assert sorted(by_rank) == [0, 1, 2] and all(len(d) == 3 for d in by_rank.values())
    assert all(m <= 0.1 for m in medians.values()), medians
    assert out["steps_lost"] == [0] * 9
    assert statistics.median(out["death_to_replacement_step_s"]) < 1.0, out["death_to_replacement_step_s"]
    assert out["scale_to_first_step_s"] < 0.2, out["scale_to_first_step_s"]
    # every worker runs on the coordinator's node here: its lifeline (actors/lifeline.py) makes each death
    # known 1-3 ms after the kill, where without it the kernel's teardown held it to 23-30 ms
    known = [p["kill -> death known"] for p in out["phases_s"] if p["kill -> death known"] is not None]
    assert len(known) == 9 and statistics.median(known) <= 0.010, known
