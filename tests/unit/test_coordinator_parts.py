"""The coordinator's parts on their own (actors/control/): the state file a restarted incarnation carries on
from (`StateFile`, restart.py) and the plans (`Plans`, plans.py), each built from real books, journals and
state machines with the parts around them faked. The whole coordinator runs in test_coordinator_paths.py."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from actors.control.book import MembershipBook
from actors.control.feed import Feed
from actors.control.job_state import JobStateMachine
from actors.control.journal import SAVED, Journal
from actors.control.members import Member
from actors.control.plans import Plans
from actors.control.restart import StateFile
from actors.control.run_identity import RunIdentity
from actors.control.tasks import Tasks
from actors.plan import Plan
from algorithms.rules.kinds import POLICY_KINDS
from algorithms.rules.supervision import JobState, MemberState
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup

S = MemberState
KIND = POLICY_KINDS["bsp"]


def job_config(**workers: Any) -> JobConfig:
    return parse(JobConfig, config_from_dict({
        "name": "job", "workers": {"count": 2, "min": 1, "max": 3, **workers},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
        "comm": {"timeout_s": 5.0}, "stop": {"max_steps": 10}}).to_dict())


class Counted:
    """The launcher's or the spare pool's count of starts, and the spares kept now."""

    def __init__(self, started: int, kept: tuple[str, ...] = ()) -> None:
        self.started, self.kept = started, list(kept)

    def names(self) -> list[str]:
        return list(self.kept)


class RecordingGroup(FakeWorkerGroup):
    def __init__(self, state_file: Path) -> None:
        super().__init__()
        self.state_file = state_file
        self.published: list[tuple[str, dict, str]] = []
        """(name, record, the state file's state when the record was published)."""

    def publish_record(self, name: str, record: dict) -> None:
        self.published.append((name, record, json.loads(self.state_file.read_text())["state"]))


def state_file(tmp_path: Path, saved: dict | None) -> tuple[StateFile, JobStateMachine, MembershipBook, Journal,
                                                             RecordingGroup]:
    cfg, journal = job_config(), Journal(tmp_path, keep_checkpoints=1)
    group, book = RecordingGroup(tmp_path / SAVED), MembershipBook(cfg, "r1", KIND)
    book.members["w0"] = Member("w0", None, state=S.TRAINING)
    run = RunIdentity(cfg, {}, "r1", tmp_path, incarnation=1)
    parts: dict[str, StateFile] = {}
    job = JobStateMachine("job", 1.0, journal.event, lambda: parts["file"].save(),
                          lambda state, number: parts["file"].ended(state, number), saved)
    parts["file"] = StateFile(run, journal, book, job, Counted(7), Counted(2, ("job/r1/spare3",)), group, saved)
    return parts["file"], job, book, journal, group


def saved_state(journal: Journal, number: int) -> dict:
    assert journal.wait_saved(number, 10)
    return json.loads((journal.run_dir / SAVED).read_text())


def test_a_restarted_incarnation_saves_the_dead_ones_members_until_it_has_re_attached_them(tmp_path):
    """Until its workers are re-attached, a restart's book knows none of them: saving its own would lose
    them for the next restart. It saves the dead incarnation's members and spares (its own spares too),
    and its own book once recovered. Switched off, the first state file names only w0."""
    saved = {"members": {"w0": {"state": "TRAINING"}, "w1": {"state": "TRAINING"}}, "spares": ["job/r1/spare1"],
             "state": "RUNNING", "stop_kind": None, "cause": None, "running_since": 2.0, "started_at": 1.0}
    file, job, _, journal, _ = state_file(tmp_path, saved)
    assert not file.recovered.is_set()
    first = saved_state(journal, file.save())
    assert set(first["members"]) == {"w0", "w1"} and first["spares"] == ["job/r1/spare1", "job/r1/spare3"]
    assert (first["incarnation"], first["state"], first["started_workers"], first["started_spares"]) == (1, "RUNNING", 7, 2)
    file.recovered.set()
    again = saved_state(journal, file.save())
    assert set(again["members"]) == {"w0"} and again["spares"] == ["job/r1/spare3"]
    journal.close()


def test_the_end_is_announced_only_once_the_state_file_holds_it(tmp_path):
    """A terminal transition saves the state and waits for that snapshot before the job's record goes to
    Ray's key-value store: `status NAME` reads the run folder once the record says the job ended."""
    file, job, _, journal, group = state_file(tmp_path, None)
    assert file.recovered.is_set(), "a first incarnation has nothing to re-attach"
    job.transition(JobState.RUNNING, "started")
    job.transition(JobState.FINISHED, "done")
    assert [(name, record["state"], on_disk) for name, record, on_disk in group.published] == \
        [("job", "FINISHED", "FINISHED")]
    assert group.published[0][1] == {"run_id": "r1", "run_dir": str(tmp_path), "state": "FINISHED",
                                     "storage": None, "storage_options": {}}
    journal.close()


class Publisher:
    """Publishes the book's next plan, as the real one does, without anyone to hand it to."""

    def __init__(self, book: MembershipBook) -> None:
        self.book = book
        self.published: list[tuple[tuple[str, ...], bool, bool]] = []

    def publish(self, members: tuple[str, ...], reason: str, history_step: int, new_epoch: bool = False,
                aborts: bool = False) -> Plan:
        self.published.append((members, new_epoch, aborts))
        return self.book.next_plan(members, reason, incarnation=0, store_host="h", store_port=0,
                                   history_step=history_step, new_epoch=new_epoch)


class History:
    written_step = 4


class Spares:
    def wake(self) -> None:
        pass


def plans(holds_state: bool = True, **workers: Any) -> tuple[Plans, Publisher, JobStateMachine, MembershipBook]:
    cfg = job_config(**workers)
    book = MembershipBook(cfg, "r1", KIND)
    for slot in ("w0", "w1"):
        book.members[slot] = Member(slot, None, state=S.TRAINING, holds_state=holds_state)
    book.next_plan(("w0", "w1"), "start", incarnation=0, store_host="h", store_port=0, history_step=0)
    job = JobStateMachine("job", 1.0, lambda *a, **k: None, lambda: 0, lambda state, number: None)
    job.transition(JobState.RUNNING, "started")
    publisher = Publisher(book)
    made = Plans(cfg, book, publisher, job, History(), Feed(), Spares(), FakeWorkerGroup(),
                 lambda *a, **k: None, lambda slots, reason, detector: None, lambda: 0, Tasks())
    return made, publisher, job, book


def test_a_re_form_aborts_the_epoch_in_its_plan_once_per_comm_timeout():
    """Members whose group failed with everyone alive start over in a new epoch whose plan aborts the old
    one (a reshape: RESHAPING until it commits); more failures of the same group within `comm.timeout_s`
    publish nothing more."""
    made, publisher, job, book = plans()
    made.reform("w1's collective failed with every member alive")
    assert publisher.published == [(("w0", "w1"), True, True)]
    assert job.state == JobState.RESHAPING and book.epoch == 2 and len(book.pending) == 1
    made.reform("w0's collective failed with every member alive")
    assert len(publisher.published) == 1, "a second re-form within comm.timeout_s"


def test_joiners_alone_are_never_re_formed():
    """Members none of which holds the committed state cannot form an epoch that trains on: the end or the
    failure of the state's holders decides, not a re-form."""
    made, publisher, job, _ = plans(holds_state=False)
    made.reform("a collective failed")
    assert publisher.published == [] and job.state == JobState.RUNNING


def test_a_scale_outside_the_bounds_or_of_a_stopping_job_is_refused_in_one_line():
    made, publisher, job, book = plans()
    with pytest.raises(ValueError, match=r"scale: 4 workers is outside \[workers.min, workers.max\] = \[1, 3\]"):
        asyncio.run(made.scale(4))
    job.decide_stop("STOPPED", "stop requested")
    with pytest.raises(ValueError, match="scale: the job is stopping; only a running or paused job can be scaled"):
        asyncio.run(made.scale(3))
    assert book.target_count == 2 and publisher.published == [], "a refused scale changes nothing"
