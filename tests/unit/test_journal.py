"""The journal (actors/control/journal.py): events, history progress, the state file, checkpoints. No Ray."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from actors.control.checkpoint_store import restorable_step
from actors.control.journal import EVENTS_KEPT, RESHAPES_SHOWN, Journal
from actors.runs import runfiles
from algorithms.rules.kinds import Reporter
from testkit.stores import HookedStore, failing


def record(step: int, t: float, **extra) -> dict:
    return {"step": step, "time": t, "loss": 1.0 / step, "world_size": 2, "global_batch": 16, "micro_steps": 1,
            "membership_epoch": 1, **extra}


def test_memory_keeps_a_bounded_tail_of_the_events_and_the_file_keeps_all(tmp_path):
    journal = Journal(tmp_path, keep_checkpoints=2)
    n = 2500
    for i in range(n):
        journal.event("reshape", f"reshape {i}", membership_epoch=i)
    on_disk = [e["reason"] for e in runfiles.read_jsonl(tmp_path / "events.jsonl")]
    assert len(on_disk) == n and len(set(on_disk)) == n, "the file keeps every event"
    assert [e.reason for e in journal.events] == on_disk[-EVENTS_KEPT:], "memory keeps the newest, in the file's order"
    assert [e.reason for e in journal.recent_reshapes()] == on_disk[-RESHAPES_SHOWN:]


def test_records_move_the_progress_and_throughput_counts_the_last_five_seconds(tmp_path):
    journal = Journal(tmp_path, keep_checkpoints=2)
    journal.open_history(Reporter.RANK0, 0)
    now = time.time()
    for step in range(1, 101):  # 10 steps/s over 10 s
        assert journal.offer(record(step, now + step / 10, metrics={"accuracy": step / 100}))
    assert not journal.offer(record(50, now + 20)), "a step already in history is not news"
    assert journal.loss == 1.0 / 100 and journal.metrics == {"accuracy": 1.0}
    assert abs(journal.throughput() - 10.0) < 1e-6
    assert len(journal.recent) <= 51, "only the last five seconds are kept"
    assert not journal.offer({"step": 100, "time": now, "final": True, "metrics": {"accuracy": 0.5}})
    assert journal.metrics["accuracy"] == 0.5, "a final evaluation updates status, not history"
    journal.history.close()  # the job ended: rank 0's newest step, held until then, is final
    journal.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 101))


def test_the_state_file_round_trips_with_the_events_and_the_step(tmp_path):
    journal = Journal(tmp_path, keep_checkpoints=2)
    journal.open_history(Reporter.RANK0, 0)
    journal.offer(record(1, time.time()))
    journal.loss = 0.5
    number = journal.save_state({"epoch": 3, "loss": 0.5, "metrics": {"a": 1.0}})
    assert journal.wait_saved(number, 10)
    journal.event("info", "hello")
    journal.history.close()
    journal.close()
    again = Journal(tmp_path, keep_checkpoints=2)
    saved = again.load_state()
    assert saved["epoch"] == 3 and again.loss == 0.5 and again.metrics == {"a": 1.0} and again.step == 1
    assert [e.reason for e in again.events] == ["hello"]


def test_a_checkpoint_is_verified_before_it_is_read(tmp_path):
    async def scenario():
        journal = Journal(tmp_path, keep_checkpoints=2)
        path = await journal.checkpoints.save(7, b"x" * 100)
        assert journal.checkpoints.last == (7, str(path))
        assert await journal.checkpoints.read(path) == b"x" * 100
        Path(path).write_bytes(b"x" * 50)  # torn
        try:
            await journal.checkpoints.read(path)
        except RuntimeError as err:
            return str(err)
        raise AssertionError("a torn checkpoint was read")
    problem = asyncio.run(scenario())
    assert "manifest says 100" in problem, problem


def test_fired_faults_outlive_the_journal(tmp_path):
    Journal(tmp_path, keep_checkpoints=1).fault_fired(2)
    assert Journal(tmp_path, keep_checkpoints=1).fired_faults == {2}


def test_a_torn_last_line_does_not_swallow_the_first_record_after_a_restart(tmp_path):
    """A SIGKILL (or a mirror copy) can leave an appended file ending mid-line; a restarted coordinator
    appends to it. The fragment is cut on open, so the next record is a line of its own, not glued onto
    the fragment (read back as garbage and skipped: the record the restart re-collected would be lost)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "history.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    (run / "events.jsonl").write_text('{"time": 1.0, "kind": "info", "reason": "a"}\n{"time": 2.0, "ki')
    journal = Journal(run, keep_checkpoints=1)
    history = journal.open_history(Reporter.SERVER, written_step=2)
    history.offer({"step": 3, "time": 3.0})
    journal.event("info", "after the restart")
    journal.step_times({"w0": 0.1})
    journal.close()
    assert [r["step"] for r in runfiles.read_jsonl(run / "history.jsonl")] == [1, 2, 3]
    assert [e["reason"] for e in runfiles.read_jsonl(run / "events.jsonl")] == ["a", "after the restart"]
    (run / "step_times.jsonl").write_bytes((run / "step_times.jsonl").read_bytes() + b'{"time": 9, "st')
    journal = Journal(run, keep_checkpoints=1)
    journal.step_times({"w0": 0.2})
    journal.close()
    assert [r["step_s"]["w0"] for r in runfiles.read_jsonl(run / "step_times.jsonl")] == [0.1, 0.2]


def test_a_checkpoint_that_fails_to_store_is_an_event_and_is_tried_again(tmp_path, monkeypatch):
    """A failed upload is not silent: each failed try is a `checkpoint_failed` event naming the step and
    the error, the store is tried again with backoff, and status shows the last durable checkpoint."""
    from actors.control import checkpoint_store
    from actors.runs.storage import open_storage

    monkeypatch.setattr(checkpoint_store, "CHECKPOINT_RETRIES_S", (0.01, 0.01, 0.01))

    async def scenario():
        fails = [2]  # an S3 outage: two writes fail, then they work
        store = HookedStore(open_storage(str(tmp_path / "store")), failing(fails, "AWS Error SERVICE_UNAVAILABLE "
                                                                                  "during PutObject operation"))
        journal = Journal(tmp_path / "run", keep_checkpoints=2, storage=store, run_key="job/run")
        location = await journal.checkpoints.save(7, b"x" * 100)
        failed = [e for e in journal.events if e.kind == "checkpoint_failed"]
        assert [e.detail["attempt"] for e in failed] == [1, 2], [e.reason for e in journal.events]
        assert all(e.detail["step"] == 7 and "SERVICE_UNAVAILABLE" in e.detail["error"] for e in failed)
        assert location is not None and await journal.checkpoints.read(location) == b"x" * 100
        status = journal.checkpoints.status()
        assert status["step"] == 7 and status["failures"] == 2, status
        fails[0] = 100  # down for good: given up after the last retry, the job goes on
        assert await journal.checkpoints.save(9, b"y" * 100) is None
        given_up = [e for e in journal.events if e.kind == "checkpoint_failed"][-1]
        assert not given_up.detail["retry"] and "given up" in given_up.reason and "step 7" in given_up.reason
        assert journal.checkpoints.status()["step"] == 7, "the last durable checkpoint is still step 7"
        journal.close()
    asyncio.run(scenario())


def test_with_remote_storage_a_saved_state_is_in_the_store_before_wait_saved_returns(tmp_path):
    """"Persist before acting" (a spare's name before its start, ...) must reach the store: a coordinator
    restarted on another node reads the store's copy, not this node's disk."""
    import threading

    from actors.runs.mirror import RunMirror
    from actors.runs.storage import open_storage

    gate = threading.Event()

    store = open_storage(str(tmp_path / "store"))
    mirror = RunMirror(HookedStore(store, lambda key, data: gate.wait(60)), "job/run", tmp_path / "run")  # answers when let
    journal = Journal(tmp_path / "run", keep_checkpoints=1, storage=store, run_key="job/run", mirror=mirror)
    number = journal.save_state({"spares": ["job/run/spare1"]})
    assert not journal.wait_saved(number, 0.5), "waited only for the local disk: the store has no copy yet"
    gate.set()
    assert journal.wait_saved(number, 30)
    assert json.loads(store.read("job/run/coordinator.json")) == {"spares": ["job/run/spare1"]}
    journal.close()


def test_the_final_model_is_uploaded_on_its_own_and_waited_for_by_its_size(tmp_path, monkeypatch):
    """`model.pt` (GBs for a real model) no longer goes through the mirror, where it held up status.json
    and was cut off by the mirror's 30 s final flush: it is uploaded directly, and the journal's close
    waits for it as long as its size needs."""
    import threading

    from actors.control import checkpoint_store
    from actors.runs.mirror import RunMirror
    from actors.runs.storage import open_storage

    gate = threading.Event()

    store = open_storage(str(tmp_path / "store"))
    slow = HookedStore(store, lambda key, data: key.endswith("model.pt") and gate.wait(60))
    mirror = RunMirror(slow, "job/run", tmp_path / "run")
    journal = Journal(tmp_path / "run", keep_checkpoints=1, storage=slow, run_key="job/run", mirror=mirror)
    journal.checkpoints.write_model(b"m" * 1000)
    journal.write_status({"state": "FINISHED"})
    assert mirror.flush(5), "status.json waited behind the model's upload"
    assert json.loads(store.read("job/run/status.json")) == {"state": "FINISHED"}
    waits = []
    monkeypatch.setattr(checkpoint_store, "model_upload_timeout", lambda size: waits.append(size) or 60.0)
    threading.Timer(0.2, gate.set).start()
    journal.close()
    assert store.read("job/run/model.pt") == b"m" * 1000
    assert waits == [1000], "the wait for the model's upload is scaled to its size"


def test_a_busy_store_holds_one_checkpoint_waiting_and_a_newer_one_replaces_it(tmp_path):
    """One checkpoint is stored at a time and one waits: a third replaces the waiting one (an event names
    both), so a store that hangs holds two blobs, not every checkpoint since it hung."""
    import threading

    from actors.runs.storage import open_storage

    gate = threading.Event()

    async def scenario():
        hung = HookedStore(open_storage(str(tmp_path / "s")), lambda key, data: gate.wait(60))
        journal = Journal(tmp_path / "run", keep_checkpoints=3, storage=hung, run_key="job/run")
        first = asyncio.ensure_future(journal.checkpoints.save(10, b"a" * 10))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(journal.checkpoints.save(20, b"b" * 10))
        await asyncio.sleep(0.05)
        third = asyncio.ensure_future(journal.checkpoints.save(30, b"c" * 10))
        assert await second is None, "the waiting checkpoint is replaced by the newer one"
        replaced = [e for e in journal.events if e.kind == "checkpoint_failed"]
        assert replaced and replaced[0].detail["step"] == 20 and replaced[0].detail["replaced_by"] == 30
        gate.set()
        assert await first is not None and await third is not None
        assert [e.detail["step"] for e in journal.events if e.kind == "checkpoint"] == [10, 30]
        journal.close()
    asyncio.run(scenario())


def test_a_failing_store_is_an_event_without_waiting_for_the_next_state_save(tmp_path):
    """The coordinator's loop asks (`check_mirror`) every pass: a quiet job, which saves no state, is told
    once that its remote copy lags."""
    from actors.runs.mirror import RunMirror
    from actors.runs.storage import open_storage

    (tmp_path / "run").mkdir()
    down = HookedStore(open_storage(str(tmp_path / "s")), failing([10**9], "503 Service Unavailable"))
    mirror = RunMirror(down, "job/run", tmp_path / "run", interval_s=0.05)
    journal = Journal(tmp_path / "run", keep_checkpoints=1, storage=open_storage(str(tmp_path / "s")),
                      run_key="job/run", mirror=mirror)
    journal.write_status({"state": "RUNNING"})
    assert not mirror.flush(0.5) and mirror.error
    journal.check_mirror()
    journal.check_mirror()
    told = [e for e in journal.events if "remote copy lags" in e.reason]
    assert len(told) == 1 and "503 Service Unavailable" in told[0].reason, [e.reason for e in journal.events]
    mirror.close(0.1)


def test_a_checkpoint_being_stored_is_pending_and_counts_as_restorable_until_its_store_ends(tmp_path):
    """A loss of every member restarts from the newest checkpoint, a stored one or one still being
    stored (the restore waits for it): a job that loses every member while its first checkpoint is being
    stored does not fail for want of one. The store takes 0.3 s here (`store_delay_s`); the test waits
    for the store's own events, not for time."""
    async def scenario():
        journal = Journal(tmp_path, keep_checkpoints=2, store_delay_s=0.3)
        assert journal.checkpoints.pending() is None and restorable_step(journal.checkpoints.last, None) is None
        saving = asyncio.get_running_loop().create_task(journal.checkpoints.save(20, b"state at 20"))
        await asyncio.sleep(0)  # the store starts (in a thread): the checkpoint is pending, not stored
        assert journal.checkpoints.last is None and journal.checkpoints.pending() == 20
        assert restorable_step(journal.checkpoints.last, journal.checkpoints.pending()) == 20
        newest = await journal.checkpoints.newest()  # waits for the store under way
        assert newest is not None and newest[0] == 20 and journal.checkpoints.pending() is None
        await saving
        assert restorable_step(journal.checkpoints.last, None) == 20
        assert restorable_step((20, "p"), 40) == 40 and restorable_step((40, "p"), None) == 40
    asyncio.run(scenario())


def test_rounds_further_apart_than_the_window_still_show_tokens_per_second_and_a_stall_shows_none(tmp_path, monkeypatch):
    """DiLoCo-style rounds 8 s apart: the window holds the last few records however far apart, so the
    goodput reads their tokens over their span (it read nothing before: one record in 5 s); one worker's
    rate on its compute reads the step less its waits; a stall longer than twice the gap reads none."""
    import actors.control.journal as journal_module

    journal = Journal(tmp_path, keep_checkpoints=2)
    journal.open_history(Reporter.RANK0, 0)
    clock = [1000.0]
    monkeypatch.setattr(journal_module.time, "monotonic", lambda: clock[0])
    for step in range(1, 6):  # a round every 8 s, 4 workers, 4,096 tokens a round, 6 s of it computing
        clock[0] += 8.0
        assert journal.offer({**record(step, 1000.0 + 8 * step), "tokens": 4096, "world_size": 4,
                              "step_time": 8.0, "wait_s": 2.0})
    assert journal.tokens_throughput() == 4096 / 8
    assert journal.worker_tokens_per_compute_s() == 1024 / 6
    clock[0] += 17.0  # more than twice the gap with no record
    assert journal.tokens_throughput() is None and journal.worker_tokens_per_compute_s() is None
