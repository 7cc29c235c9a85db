"""TensorBoard (actors/tracking.py): the job's scalars read back with TensorBoard's own reader match
history step for step, from one writer, with no step written twice across a coordinator restart."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tensorboardX", reason="tracking.tensorboard needs tensorboardX (the [tracking] extra)")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the reader is TensorBoard's own (the [test] extra)")

from test_coordinator_paths import config, ended, events, run, started, until  # noqa: E402

from actors.tracking import TensorBoard, written_steps  # noqa: E402
from algorithms.supervision import JobState  # noqa: E402
from testkit.fake_workers import FakeWorkerGroup  # noqa: E402


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def record(step: int, **over) -> dict:
    return {"step": step, "time": 1000.0 + step, "loss": 1.0 / step, "world_size": 2, "membership_epoch": 1,
            "bytes_sent": 100 * step, **over}


def test_a_job_s_scalars_match_history_step_for_step(tmp_path):
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("tb", tracking={"tensorboard": "tb"}), tmp_path, group)
        await group.commit(coord, 5)
        group.die("w1")
        await until(lambda: coord.book.plan.members == ("w0", "w2"), "the survivors' plan")
        await group.commit(coord, 3)
        await coord.request_stop()
        await group.commit(coord, 2)
        assert await ended(coord) == JobState.STOPPED
        assert not [e for e in events(coord, "info") if "TensorBoard failed" in e.reason]
    run(scenario())
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    got = scalars(tmp_path / "tb")
    assert got["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in history]
    assert got["world_size"] == [(r["step"], r["world_size"]) for r in history]
    assert got["membership_epoch"] == [(r["step"], r["membership_epoch"]) for r in history]
    assert [s for s, _ in got["bytes/sent"]] == [r["step"] for r in history]


def test_a_restarted_writer_writes_only_the_steps_after_the_newest_written(tmp_path):
    board = TensorBoard(tmp_path, per_member=False, incarnation=0)
    for step in range(1, 6):
        board.record(record(step))
    board.close()
    assert written_steps(tmp_path)["loss"] == 5
    with open(next(tmp_path.glob("events.out.tfevents.*")), "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00torn")  # the crash cut a record short
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(record(step)) + "\n" for step in range(1, 9)) + '{"step": 9, "ti')
    again = TensorBoard(tmp_path, per_member=False, incarnation=1)
    assert again.catch_up(history) == 3, "steps 6..8: held by history, never written by the dead writer"
    again.record(record(7))  # a member's late report of a step already written
    again.record(record(9))
    again.close()
    assert [s for s, _ in scalars(tmp_path)["loss"]] == list(range(1, 10)), "each step once"


def test_the_per_member_kinds_write_each_member_under_its_slot(tmp_path):
    board = TensorBoard(tmp_path, per_member=True)
    for step in (1, 2):
        for slot in ("w0", "w1"):
            board.record(record(step, slot=slot, loss=step + (0.5 if slot == "w1" else 0.0)))
    board.record(record(2, slot="w0"))
    board.close()
    got = scalars(tmp_path)
    assert got["loss/w0"] == [(1, 1.0), (2, 2.0)] and got["loss/w1"] == [(1, 1.5), (2, 2.5)]
