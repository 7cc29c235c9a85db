"""The lab grid's time to the target (orchestrator/calibration.py `accuracy_evals`), which decides which policy
was the fastest in the grid and in every held-out cell: counted from the start of training, for a policy
whose first record comes at its first commit (a periodic round) as for one that records every step."""
from __future__ import annotations

import pytest

from orchestrator.calibration import accuracy_evals, first_at, from_start


def history(first: int, every: int, last: int, pace: float, hit: int) -> list[dict]:
    """Records of a run whose every step takes `pace` seconds from t = 100: one at each commit (`first`, then
    every `every` steps), and an evaluation at or above the target at step `hit`."""
    return [{"step": s, "time": 100.0 + s * pace, **({"metrics": {"accuracy": 0.97 if s >= hit else 0.5}} if s % 16 == 0 else {})}
            for s in range(first, last + 1, every)]


@pytest.mark.parametrize("first, every", [(1, 1), (8, 8), (16, 16)])
def test_the_time_to_the_target_counts_the_steps_before_the_first_commit(first, every):
    """Each step takes 20 ms and the target is reached at step 112: 2.24 s from the start, whether the
    policy records every step (BSP) or only at its rounds (local SGD h=8, DiLoCo h=16). Timed from the first
    record, as before 2026-11-29, DiLoCo's came out 1.92 s (its first 16 steps left out) and BSP's 2.22."""
    t, step = first_at(accuracy_evals(history(first, every, 160, 0.02, 112)), 0.96)
    assert step == 112 and t == pytest.approx(112 * 0.02)


def test_rows_written_before_are_moved_back_by_the_steps_before_their_first_commit():
    """A row timed from its first commit gets its first commit's steps back at its own time per step
    (`diloco h=16`: 16 steps; BSP: 1); a row timed from the start is left as it is."""
    old = {"policy": "diloco h=16", "to_target_s": 1.92, "step_s": 0.02}
    assert from_start(old)["to_target_s"] == pytest.approx(2.24)
    assert from_start(old)["to_target_s_from_commit"] == 1.92
    assert from_start({**old, "policy": "bsp", "to_target_s": 2.22})["to_target_s"] == pytest.approx(2.24)
    assert from_start({**old, "policy": "streaming_diloco h=16 f=4", "to_target_s": 2.14})["to_target_s"] == pytest.approx(2.24)
    new = {**old, "timed_from": "start"}
    assert from_start(new) == new
    assert from_start(old, started="local_sgd h=8")["to_target_s"] == pytest.approx(1.92 + 8 * 0.02)
