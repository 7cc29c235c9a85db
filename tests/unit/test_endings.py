"""The job's final model and a failed job's committed states (actors/control/endings.py). No Ray."""
from __future__ import annotations

import asyncio

import pytest

from actors.control.book import MembershipBook
from actors.control.endings import committed_states, final_model
from actors.control.members import Member
from actors.plan import WorkerSpec
from algorithms.rules.kinds import SYNCHRONOUS, FinalModel
from algorithms.rules.supervision import MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup

S = MemberState


def setup(n: int = 3):
    cfg = parse(JobConfig, config_from_dict({
        "name": "e", "workers": {"count": n}, "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
        "stop": {"max_steps": 10}}).to_dict())
    group, book = FakeWorkerGroup(), MembershipBook(cfg, "r", SYNCHRONOUS)
    for i in range(n):
        handle = group.create(f"e/r/w{i}", WorkerSpec("e", "r", f"w{i}", "/tmp", "e", "ns", {}, ()))
        book.members[f"w{i}"] = Member(f"w{i}", handle, state=S.FINISHED)
    book.next_plan(tuple(book.members), "start", incarnation=0, store_host="h", store_port=0, history_step=0)
    return group, book


def test_the_model_is_rank_0s_or_the_next_holders_when_rank_0_died_after_the_others_finished():
    async def scenario():
        group, book = setup()
        assert (await final_model(FinalModel.RANK0, book, group, None, lambda *a, **k: None, {}))[1] == "w0"
        book.members["w0"].state = S.DEAD
        book.members["w1"].holds_state = False  # a joiner that never received the state
        assert (await final_model(FinalModel.RANK0, book, group, None, lambda *a, **k: None, {}))[1] == "w2"
        book.members["w2"].state = S.DEAD
        with pytest.raises(RuntimeError, match="no live member holds the committed state"):
            await final_model(FinalModel.RANK0, book, group, None, lambda *a, **k: None, {})
    asyncio.run(scenario())


def test_the_average_is_over_the_replicas_that_hold_a_state(monkeypatch):
    averaged: list[int] = []
    monkeypatch.setattr("actors.control.endings.checkpoints.average_states",
                        lambda blobs: averaged.append(len(blobs)) or b"avg")
    async def scenario():
        group, book = setup(4)
        book.members["w3"].holds_state = False
        notes, metrics = [], {}
        blob, source = await final_model(FinalModel.AVERAGE, book, group, None, lambda *a, **k: notes.append(a[1]), metrics)
        assert (blob, source, averaged) == (b"avg", "the replicas", [3])
        assert notes[0].startswith("final model: the average of 3 replicas (w0, w1, w2)")
    asyncio.run(scenario())


def test_a_failed_jobs_members_report_their_committed_states_and_a_silent_one_says_so():
    async def scenario():
        group, book = setup(2)
        group.current("w0").step = 12
        group.current("w1").alive = False
        assert await committed_states(book, group) == {"w0": {"step": 12, "checksum": 0}, "w1": {"error": "no answer"}}
    asyncio.run(scenario())
