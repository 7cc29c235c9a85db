"""TensorBoard (actors/observe/tracking.py): the job's scalars read back with TensorBoard's own reader match
history step for step, from one writer thread, with no step written twice across a coordinator restart,
and redone steps (after a restore) in place of the lost ones."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

pytest.importorskip("tensorboardX", reason="tracking.tensorboard needs tensorboardX (the [tracking] extra)")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the reader is TensorBoard's own (the [test] extra)")

from test_coordinator_paths import config, ended, events, run, started, until  # noqa: E402

from actors.observe.tracking import TensorBoard, last_written  # noqa: E402
from algorithms.rules.supervision import JobState  # noqa: E402
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
    assert last_written(tmp_path) == {"": (5, 1005.0)}
    with open(next(tmp_path.glob("events.out.tfevents.*")), "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00torn")  # the crash cut a record short
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(record(step)) + "\n" for step in range(1, 9)) + '{"step": 9, "ti')
    again = TensorBoard(tmp_path, per_member=False, incarnation=1, history=history)
    again.record(record(9))
    again.close()
    assert again.caught_up == 3, "steps 6..8: held by history, never written by the dead writer"
    assert [s for s, _ in scalars(tmp_path)["loss"]] == list(range(1, 10)), "each step once"


def test_the_per_member_kinds_write_each_member_under_its_slot(tmp_path):
    board = TensorBoard(tmp_path, per_member=True)
    for step in (1, 2):
        for slot in ("w0", "w1"):
            board.record(record(step, slot=slot, loss=step + (0.5 if slot == "w1" else 0.0)))
    board.close()
    got = scalars(tmp_path)
    assert got["loss/w0"] == [(1, 1.0), (2, 2.0)] and got["loss/w1"] == [(1, 1.5), (2, 2.5)]


def test_redone_steps_after_a_restore_replace_the_lost_ones_also_across_a_restart(tmp_path):
    """Every member was lost at step 10 and fresh ones redo steps 6.. from the checkpoint at step 5: the
    redone values replace the lost lineage's (TensorBoard's purge), and a writer restarted in the middle
    of the redo, after history took more of it than the dead writer wrote, writes the rest."""
    lost = [record(step) for step in range(1, 11)]
    redone = [record(step, loss=10.0 + step, time=2000.0 + step) for step in range(6, 9)]
    expected = [(s, pytest.approx(1.0 / s)) for s in range(1, 6)] + [(s, 10.0 + s) for s in range(6, 9)]
    board = TensorBoard(tmp_path / "one", per_member=False)
    for r in lost + redone:
        board.record(r)
    board.close()
    assert scalars(tmp_path / "one")["loss"] == expected, "the redone steps, not the lost ones"

    dead = TensorBoard(tmp_path / "two", per_member=False)
    for r in lost + redone[:1]:
        dead.record(r)
    dead.close()
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(r) + "\n" for r in lost + redone))
    again = TensorBoard(tmp_path / "two", per_member=False, incarnation=1, history=history)
    again.close()
    assert again.caught_up == 2, "steps 7 and 8 of the redo"
    assert scalars(tmp_path / "two")["loss"] == expected


def test_the_per_member_kinds_redo_every_member_from_the_checkpoint(tmp_path):
    board = TensorBoard(tmp_path, per_member=True)
    for step in range(1, 5):
        for slot in ("w0", "w1"):
            board.record(record(step, slot=slot))
    for step in (3, 4):  # restored at step 2: w1 reports its redone steps first
        for slot in ("w1", "w0"):
            board.record(record(step, slot=slot, loss=100.0 + step))
    board.close()
    got = scalars(tmp_path)
    for slot in ("w0", "w1"):
        assert got[f"loss/{slot}"] == [(1, 1.0), (2, 0.5), (3, 103.0), (4, 104.0)], slot


def test_scalars_are_written_by_the_writer_s_thread_not_the_caller_s(tmp_path):
    """The coordinator's event loop only hands a record over; tensorboardX's protobufs are built in the
    writer's thread, a batch about once a second."""
    board = TensorBoard(tmp_path, per_member=False)
    writers: set[str] = set()
    add = board.writer.add_scalar
    board.writer.add_scalar = lambda *a, **k: (writers.add(threading.current_thread().name), add(*a, **k))
    for step in range(1, 4):
        board.record(record(step))
    board.close()
    assert writers and threading.current_thread().name not in writers, writers
    assert [s for s, _ in scalars(tmp_path)["loss"]] == [1, 2, 3]


def test_a_restarted_writer_rewrites_a_step_history_took_in_another_version(tmp_path):
    """The dead writer wrote step 6 as first reported; history holds step 6 as its members redid it in a
    newer epoch (the first report never reached history): the new writer writes history's step 6 over it."""
    dead = TensorBoard(tmp_path, per_member=False)
    for step in range(1, 7):
        dead.record(record(step))
    dead.close()
    history = tmp_path / "history.jsonl"
    redone = [record(6, loss=60.0, time=2006.0, membership_epoch=2), record(7, time=2007.0, membership_epoch=2)]
    history.write_text("".join(json.dumps(r) + "\n" for r in [record(s) for s in range(1, 6)] + redone))
    again = TensorBoard(tmp_path, per_member=False, incarnation=1, history=history)
    again.close()
    assert again.caught_up == 2
    assert scalars(tmp_path)["loss"][4:] == [(5, pytest.approx(0.2)), (6, 60.0), (7, pytest.approx(1 / 7))]
