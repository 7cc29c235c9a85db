"""`python -m orchestrator calibrate` (orchestrator/calibration.py): the convergence factors `plan` and `auto`
rank with, computed from the lab grid's stored result rows without training anything. The committed
orchestrator/convergence.json is exactly what the stored rows give; a file of rows gives one set per
learning rate and world size, each factor the median steps over seeds relative to BSP's; bad input is one
line and exit 2, with nothing written."""
from __future__ import annotations

import json

import pytest

from orchestrator import calibration, cli
from orchestrator.planning.ranking import FACTORS_PATH, load_factors


def test_the_stored_rows_give_the_committed_convergence_file(capsys):
    """benchmarks/results/tradeoffs*.jsonl, five files of four (rate, world size) points, byte for byte."""
    rows = calibration.default_rows()
    assert [p.name for p in rows] == ["tradeoffs.jsonl", "tradeoffs_lr02.jsonl", "tradeoffs_seeds.jsonl",
                                      "tradeoffs_w8.jsonl", "tradeoffs_w8_lr02.jsonl"]
    computed = calibration.file_text(calibration.calibrated(rows, {}))
    assert computed == FACTORS_PATH.read_text(), "orchestrator/convergence.json is not what the stored rows give"
    assert cli.main(["calibrate", "--check"]) == 0, capsys.readouterr()


def row(policy: str, seed: int, steps: int | None, lr: float = 0.1, workers: int = 4, network: str = "10g",
        condition: str = "none") -> dict:
    return {"policy": policy, "network": network, "condition": condition, "seed": seed, "lr": lr, "workers": workers,
            "step_s": 0.02, "bytes_per_step": 1e6, "to_target_s": None if steps is None else steps * 0.02,
            "timed_from": "start", "steps_to_target": steps}


def write_rows(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_point_gets_the_median_steps_over_seeds_relative_to_bsp_and_other_sets_are_kept(tmp_path, capsys):
    """Three seeds at lr 0.05 with 6 workers: BSP 100, 80, 90 steps (median 90); diloco 81, 72, 99 (median
    81: 0.9); shadow reaches the target in one seed of three (missed: no factor); rows of other cells and a
    seed-less straggler cell change nothing. The file's set at lr 0.1 with 4 workers stays as it was."""
    rows = [row("bsp", s, n, 0.05, 6) for s, n in enumerate((100, 80, 90))]
    rows += [row("diloco h=16", s, n, 0.05, 6) for s, n in enumerate((81, 72, 99))]
    rows += [row("shadow ma", s, n, 0.05, 6) for s, n in enumerate((50, None, None))]
    rows += [row("diloco h=16", 0, 10, 0.05, 6, network="100m"), row("bsp", 0, 5, 0.05, 6, condition="straggler")]
    source = write_rows(tmp_path / "grid.jsonl", rows)
    out = tmp_path / "convergence.json"
    out.write_text(FACTORS_PATH.read_text())
    kept = json.loads(out.read_text())["sets"][0]

    assert cli.main(["calibrate", str(source), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    sets = json.loads(out.read_text())["sets"]
    new = next(s for s in sets if s["measured_at"]["lr"] == 0.05)
    assert new["factors"] == {"bsp": 1.0, "diloco h=16": 0.9} and new["bsp_steps"] == 90
    assert new["measured_at"] == {"target": 0.96, "lr": 0.05, "workers": 6, "global_batch": 192}
    assert new["source"].startswith(f"{source}: digits MLP (512 hidden), 6 workers, SGD lr 0.05") and "median of 3 seeds" in new["source"]
    assert kept in sets and len(sets) == 5
    assert [(s["measured_at"]["workers"], s["measured_at"]["lr"]) for s in sets] == [(4, 0.1), (4, 0.02), (6, 0.05), (8, 0.1), (8, 0.02)]
    assert load_factors(out, lr=0.05, workers=6)["factors"]["diloco h=16"] == pytest.approx(0.9)


BAD = {
    "no such file": (lambda d: [str(d / "missing.jsonl")], "missing.jsonl: No such file"),
    "not JSON": (lambda d: [str(write_rows(d / "a.jsonl", [row("bsp", 0, 80)])), str(_text(d / "b.jsonl", "{\n"))],
                 "b.jsonl:1: not a JSON row"),
    "not a grid row": (lambda d: [str(_text(d / "c.jsonl", '{"policy": "bsp"}\n'))], "c.jsonl:1: not a lab grid row (no network"),
    "no rows": (lambda d: [str(_text(d / "e.jsonl", "\n"))], "no rows in"),
    "no BSP at the target": (lambda d: [str(write_rows(d / "f.jsonl", [row("bsp", 0, None), row("diloco h=16", 0, 70)]))],
                             "f.jsonl: no BSP run reached the target at 10g/none (lr 0.1, 4 workers)"),
    "a grid option without --measure": (lambda d: [str(write_rows(d / "g.jsonl", [row("bsp", 0, 80)])), "--lr", "0.02"],
                                        "--lr only with --measure"),
    "--measure with two files": (lambda d: ["a.jsonl", "b.jsonl", "--measure"], "--measure: name the one result file"),
    "--measure with bad seeds": (lambda d: [str(d / "h.jsonl"), "--measure", "--seeds", "0,x"], "--seeds 0,x: not comma-separated"),
    "--measure with an odd world size": (lambda d: [str(d / "h.jsonl"), "--measure", "--workers", "3"],
                                         "--workers: 3 is not a positive multiple of 2"),
    "an --out that is not a convergence file": (lambda d: [str(write_rows(d / "i.jsonl", [row("bsp", 0, 80)])), "--out",
                                                          str(_text(d / "notes.txt", "hello"))], "notes.txt is not a convergence file"),
}


def _text(path, text: str):
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2_and_nothing_is_written(case, tmp_path, capsys):
    argv, expected = BAD[case]
    args = argv(tmp_path)
    out = tmp_path / "out.json"
    if "--out" not in args:
        args += ["--out", str(out)]
    assert cli.main(["calibrate", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(("error: calibrate", "error: --workers")), err
    assert expected in err, err
    assert not out.exists()
