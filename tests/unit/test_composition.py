"""The replica and the coordinator are composed of objects that own their state: every field has one writer
class and no class is longer than 300 lines (`testkit/fields.py`); and the replica's parts work alone,
without a replica around them (the training state's bytes round trip, the batch feed's shares)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from actors.plan import Plan
from actors.training.batch_feed import BatchFeed
from actors.training.sources import MapSource
from actors.training.training_state import TrainingState, checksum, read_state
from algorithms.policies.base import get_algorithm
from algorithms.policies.precision import GuardedOptimizer, Precision
from core.schema import JobConfig, parse
from testkit.fields import classes_in, violations, writers

REPO = Path(__file__).resolve().parents[2]
COMPOSED = (REPO / "actors" / "training", REPO / "actors" / "control")


def test_every_field_of_the_replica_and_the_coordinator_has_one_writer_and_no_class_is_over_300_lines():
    classes = classes_in(list(COMPOSED))
    assert "Replica" in classes and "Coordinator" in classes
    found = violations(classes, max_lines=300)
    assert not found, "\n".join(found)


def test_the_listing_finds_a_field_that_a_base_and_its_subclass_both_write(tmp_path):
    """The shape the replica had: mixins over one base whose `__init__` declares every field."""
    (tmp_path / "mixins.py").write_text(
        "class Base:\n    def __init__(self):\n        self.step = 0\n        self.cursor = 0\n\n"
        "class Phase(Base):\n    def advance(self):\n        self.step, self.cursor = self.step + 1, 8\n\n"
        "class Other(Base):\n    def read(self):\n        return self.step\n")
    classes = classes_in([tmp_path])
    assert writers("Phase", classes) == {"step": ["Phase", "Base"], "cursor": ["Phase", "Base"]}
    assert sorted(violations(classes, max_lines=300)) == ["Phase.cursor has 2 writers: Phase, Base",
                                                          "Phase.step has 2 writers: Phase, Base"]
    assert violations(classes, max_lines=3) != violations(classes, max_lines=300)


def test_the_listing_finds_a_records_field_written_from_two_other_classes(tmp_path):
    """A record (a dataclass that declares its fields) that several parts write from outside has as many
    writers: the shape of the coordinator's `Member` before its fields were written only by its methods."""
    (tmp_path / "records.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Record:\n    cause: str = ''\n"
        "    def says(self, cause):\n        self.cause = cause\n\n"
        "class Launcher:\n    def failed(self, record):\n        record.cause = 'start'\n\n"
        "class Supervisor:\n    def ended(self, record):\n        record.says('died')\n")
    classes = classes_in([tmp_path])
    assert writers("Record", classes) == {"cause": ["Record", "Launcher"]}
    assert violations(classes, max_lines=300) == ["Record.cause has 2 writers: Record, Launcher"]


def _state(policy: str = "bsp") -> tuple[TrainingState, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    cfg = parse(JobConfig, {"name": "t", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "sync": {"policy": policy}})
    impl = get_algorithm(policy)(cfg.sync, cfg.compression).bind(model, optimizer)  # type: ignore[arg-type]
    return TrainingState(model, optimizer, Precision("fp32", "cpu")), impl


def test_the_training_states_bytes_round_trip_into_another_replica():
    state, impl = _state()
    loss = state.model(torch.ones(5, 4)).pow(2).sum()
    loss.backward()
    state.optimizer.step()  # momentum buffers in the optimizer's state
    state.advance(16)
    state.advance(16)
    cursor = state.commit(impl)
    assert (state.step, cursor, state.holds_state) == (2, 32, True)
    blob = state.to_bytes(impl, {"record": {"step": 2}})

    other, other_impl = _state()
    assert other.committed_view(other_impl) != state.committed_view(impl)
    saved = read_state(blob)
    other.restore(saved, other_impl)
    assert (other.step, other.cursor, other.mark_cursor, other.holds_state) == (2, 32, 32, True)
    assert other.committed_view(other_impl) == state.committed_view(impl) == (2, checksum(state.model.parameters()))
    assert saved["record"] == {"step": 2}
    mine, theirs = state.optimizer.state_dict()["state"], other.optimizer.state_dict()["state"]
    assert all(torch.equal(mine[k]["momentum_buffer"], theirs[k]["momentum_buffer"]) for k in mine)


def test_a_skip_ahead_returns_the_cursors_of_the_steps_skipped_and_marks_the_newest():
    state, _ = _state()
    assert state.skip_to(3, 10) == [0, 10, 20]
    assert (state.step, state.cursor, state.mark_cursor) == (3, 30, 30)


def test_the_batch_feed_deals_each_member_its_share_of_the_global_batch_in_micro_batches():
    data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1), torch.arange(40))
    cfg = parse(JobConfig, {"name": "t", "workload": {"factory": "orchestrator.workloads.digits:mlp", "micro_batch": 3}})
    plan = Plan(version=1, membership_epoch=1, members=("w0", "w1"), group_name="g", store_host="", store_port=0,
                timeout_s=1.0, global_batch=10)
    feeds = [BatchFeed(MapSource(data, seed=5), cfg, slot, torch.device("cpu"), cfg.to_dict()) for slot in ("w0", "w1")]
    shares = [feed.micro_batches(plan, 20, None) for feed in feeds]
    ids = np.concatenate([share[0] for share in shares])
    assert sorted(ids.tolist()) == sorted(MapSource(data, seed=5).global_batch(20, 10).tolist()), "the two halves"
    for mine, micro in shares:
        assert [len(m.ids) for m in micro] == [3, 2]  # 5 samples in micro-batches of at most 3
        assert torch.equal(torch.cat([m.batch[1] for m in micro]), torch.from_numpy(mine)), "each sample its own row"
    dealt = np.array([7, 8])
    assert feeds[0].micro_batches(plan, 20, dealt)[0] is dealt, "the ids a policy deals are what is trained"
