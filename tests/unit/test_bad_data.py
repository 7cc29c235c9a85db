"""Bad data fails in one line (docs/data.md, bad samples): a sample that raises or does not match its
batch is a `BadSample` naming its id, and the job ends FAILED on it (no retry, no retirement, no pause);
`skip` trains the mean over the samples read; a scale that leaves a member an empty share is refused at
the request; a Hugging Face `IterableDataset` is refused; a dataset's `__getitem__` is never entered by
two threads unless it says it may be. Sources and rules in process, the coordinator over fake workers."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.messages import RunOutcome
from actors.training.loader import BatchLoader
from actors.training.sources import BadSample, BlockSource, MapSource, source_for
from algorithms.rules.membership import share_refusal
from algorithms.rules.supervision import DataFault, JobState, JobView, MemberEnded, MemberState, decide
from core.schema import JobStatus, WorkloadRefused
from orchestrator.workloads.digits_sources import BadSamples
from testkit.fake_workers import FakeWorkerGroup
from testkit.harness import LocalJob
from tests.unit.test_coordinator_paths import config, ended, events, run, started, until
from tests.unit.test_policy_oracles import SEED, global_batch_ids, start_model

S = MemberState
FAULT = DataFault("sample 17", "ValueError: corrupt record 17")


# ------------------------------------------------------------------ the decision and the coordinator
def test_a_bad_sample_is_a_job_level_decision_not_a_worker_failure():
    view = JobView(state=JobState.RUNNING, plan_members=("w0", "w1", "w2"),
                   members={s: S.TRAINING for s in ("w0", "w1", "w2")}, min_workers=2, failure_budget=3)
    d = decide(view, MemberEnded("w1", "error", "x", "task error", data_fault=FAULT))
    assert d.reason == "bad training sample 17: ValueError: corrupt record 17"
    assert (d.member, d.stop_kind, d.stop_step, d.publish, d.transition) == \
        (("w1", S.FAILED), "FAILED", "held", ("w0", "w2"), JobState.STOPPING)
    assert not (d.count_failure or d.retire or d.replace or d.restore)
    alone = JobView(state=JobState.RUNNING, plan_members=("w0",), members={"w0": S.TRAINING}, checkpoint_step=40)
    d = decide(alone, MemberEnded("w0", "error", "x", "task error", data_fault=FAULT))
    assert d.end_now == JobState.FAILED and not d.restore, "a restart from the checkpoint would read it again"


def test_a_bad_sample_ends_the_job_failed_with_its_line_no_slot_retired_replaced_or_paused(tmp_path):
    """Three members, min 2 (the repro of the data review): w1's run ends on a bad sample. The job ends
    FAILED with the sample's line as its cause; the survivors stop at the step they hold; nothing is
    counted against w1's slot, nobody is started in its place, the job never pauses."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("bad", workers={"min": 2}), tmp_path, group)
        await group.commit(coord, 5)
        group.current("w1").end("error", RunOutcome(False, error="BadSample: training sample 17 could not be read: "
                                                                 "ValueError: corrupt record 17",
                                                           traceback="Traceback (fake)", data_fault=FAULT))
        assert await ended(coord) == JobState.FAILED
        assert coord.job.cause == "bad training sample 17: ValueError: corrupt record 17"
        assert group.current("w0").plan.members == ("w0", "w2") and group.current("w0").plan.stop_step == 0
        assert not coord.book.failures and not coord.book.retired
        assert len(group.workers) == 3, "a replacement was started"
        assert not [e for e in events(coord) if e.state_to == "PAUSED" or e.kind == "retired"]
        assert coord.journal.step == 5
        failure = events(coord, "failure")[0]
        assert failure.detail["detector"] == "bad sample" and failure.detail["slot"] == "w1"
    run(scenario())


def test_skipped_samples_are_counted_once_in_status(tmp_path):
    """`samples_skipped` reports from members: the count in status (a redone step's, once)."""
    async def scenario():
        group = FakeWorkerGroup()
        coord = await started(config("skipcount"), tmp_path, group)
        for ids in ([5, 9], [5], [11]):
            await coord.samples_skipped("w0", 3, ids, "workload.on_bad_sample: skip")
        assert JobStatus.from_dict(await coord.status()).samples_skipped == 3
        assert len(events(coord, "samples_skipped")) == 3
    run(scenario())


class BatchNormWorkers(FakeWorkerGroup):
    """Workers whose ready answer says the model has BatchNorm layers (as `Replica.ready` does)."""

    def _placed(self, handle):
        return dataclasses.replace(super()._placed(handle), batch_norm=True)


@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_scale_that_would_leave_an_empty_share_is_refused_at_the_request(tmp_path, batch_norm):
    """Global batch 4 (2 workers x 2, keep_global): 5 workers would leave one nothing to train (losses of
    NaN, or `every sample was bad`); with BatchNorm, 3 would leave one a single sample. Refused in one line
    naming the global batch and the largest world it allows; the largest allowed scale goes through."""
    async def scenario():
        group = BatchNormWorkers() if batch_norm else FakeWorkerGroup()
        coord = await started(config("shares", workers={"count": 2, "max": 8},
                                     workload={"batch_size": 2}), tmp_path, group)
        too_many, allowed = (3, 2) if batch_norm else (5, 4)
        with pytest.raises(ValueError) as err:
            await coord.scale(too_many)
        message = str(err.value)
        assert "\n" not in message and "global batch is 4 samples" in message
        assert f"at most {allowed} workers" in message
        assert ("BatchNorm" in message) == batch_norm
        assert coord.book.target_count == 2
        if allowed > 2:
            await coord.scale(allowed)
            await until(lambda: len(coord.book.plan.members) == allowed, "the scaled plan")
    run(scenario())


def test_the_share_rule_names_the_largest_world():
    assert share_refusal(4, 2, 2, "keep_global") is None
    assert "at most 4 workers" in share_refusal(5, 2, 2, "keep_global")
    assert "at most 2 workers" in share_refusal(3, 2, 2, "keep_global", batch_norm=True)
    assert share_refusal(64, 1, 2, "keep_worker") is None  # each share is workload.batch_size


def test_a_replica_says_whether_its_model_has_batch_norm(tmp_path):
    for factory, expected in (("bn_mlp", True), ("mlp", False)):
        cfg = {"name": "bn", "workers": {"count": 1, "cpus": 1}, "stop": {"max_steps": 1}, "eval_every": 0,
               "workload": {"factory": f"orchestrator.workloads.digits:{factory}", "params": {"hidden": 8}}}
        assert LocalJob(cfg, ["w0"], str(tmp_path / factory)).replicas["w0"].ready().batch_norm is expected


# ------------------------------------------------------------------ the replica's outcome and weighting
def bad_samples_config(bad: list[int], steps: int, count: int, batch: int, **workload) -> dict:
    return {"name": "bad", "seed": SEED, "workers": {"count": count, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits_sources:mlp",
                         "params": {"source": "bad_samples", "hidden": 16, "bad": bad}, "batch_size": batch, **workload},
            "optimizer": {"name": "sgd", "lr": 0.5}, "stop": {"max_steps": steps}, "eval_every": 0}


def test_a_run_that_meets_a_bad_sample_says_so_in_its_outcome(tmp_path):
    first = global_batch_ids(0, 8, 1437)
    job = LocalJob(bad_samples_config([first[2]], 3, 1, 8), ["w0"], str(tmp_path))
    job.publish(("w0",), 1, 8)
    job.start()
    outcome = job.wait()["w0"]
    assert not outcome.ok
    assert outcome.data_fault == DataFault(f"sample {first[2]}", f"ValueError: corrupt record {first[2]}")
    assert outcome.data_fault.line == f"bad training sample {first[2]}: ValueError: corrupt record {first[2]}"


def test_with_skip_the_steps_gradient_is_the_mean_over_the_samples_read(tmp_path):
    """Two members, global batch 8, one bad sample in w0's share: w0 reads 3, w1 reads 4. The step's
    update is SGD on the mean loss over those 7 samples (the reference, in plain torch), not their sum
    over 8."""
    first = global_batch_ids(0, 8, 1437)
    bad = first[1]
    job = LocalJob(bad_samples_config([bad], 1, 2, 4, on_bad_sample="skip"), ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 8)
    model, x, y = start_model()
    read = torch.tensor([i for i in first if i != bad])
    F.cross_entropy(model(x[read]), y[read]).backward()
    with torch.no_grad():
        expected = [p - 0.5 * p.grad for p in model.parameters()]
    for slot in ("w0", "w1"):
        for got, want in zip(job.parameters(slot), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert job.replicas["w0"].reporter.kept[-1]["skipped_samples"] == 1


# ------------------------------------------------------------------ sources
class Rows(torch.utils.data.Dataset):
    """Eight rows (features, label); `odd` maps an index to the features it has instead."""

    def __init__(self, odd: dict[int, torch.Tensor]) -> None:
        self.odd = odd

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return self.odd.get(i, torch.full((4,), float(i))), i


def test_a_row_of_another_shape_is_a_bad_sample_naming_its_id_and_skip_skips_it():
    data = Rows({2: torch.zeros(3)})
    with pytest.raises(BadSample) as err:
        MapSource(data, 0).fetch(np.array([0, 1, 2, 3]), 0)
    assert str(err.value) == ("training sample 2 does not match its batch: its layout (tensor[3] float32, int) differs "
                              "from the (tensor[4] float32, int) of the other 3 samples of its batch")
    assert err.value.fault.line.startswith("bad training sample 2: its layout (tensor[3] float32, int)")
    fetched = MapSource(data, 0, skip_bad=True).fetch(np.array([0, 1, 2, 3]), 0)
    assert fetched.ids.tolist() == [0, 1, 3] and fetched.skipped == [2] and fetched.batch[0].shape == (3, 4)


def test_a_row_of_another_dtype_is_refused_not_promoted():
    data = Rows({1: torch.ones(4, dtype=torch.float64)})
    with pytest.raises(BadSample, match=r"training sample 1 does not match its batch: its layout \(tensor\[4\] float64"):
        MapSource(data, 0).fetch(np.array([0, 1, 2]), 0)


def test_every_sample_of_a_micro_batch_bad_under_skip_names_the_first():
    x, y = torch.zeros(8, 2), torch.arange(8)
    with pytest.raises(BadSample) as err:
        MapSource(BadSamples(x, y, bad=[4, 6]), 0, skip_bad=True).fetch(np.array([4, 6]), 0)
    assert err.value.fault.line.startswith("bad training sample 4: ValueError: corrupt record 4; every sample of its")


def test_a_bad_sample_keeps_its_id_when_a_loader_process_sends_it_back():
    import pickle

    err = pickle.loads(pickle.dumps(BadSample("sample 3", "ValueError: x", "training sample 3 could not be read: x")))
    assert err.fault == DataFault("sample 3", "ValueError: x") and str(err) == "training sample 3 could not be read: x"


def test_a_ragged_hugging_face_row_is_a_bad_sample_naming_its_id():
    """Arrow reads a column of unequal rows as a list of tensors, which no loss can take: the share is read
    again row by row, and the row whose shape differs is named."""
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0], [4.0, 5.0]], "y": [0, 1, 2]})
    with pytest.raises(BadSample, match=r"training sample 1 does not match its batch: its layout \{x: tensor\[1\]"):
        source_for(table, 0).fetch(np.array([0, 1, 2]), 0)


def test_a_ray_data_column_that_cannot_be_a_tensor_or_is_missing_names_the_rows(monkeypatch):
    source = BlockSource([(None, 2), (None, 2)], seed=0)
    blocks = {0: {"x": np.ones((2, 3)), "text": np.array(["a", "b"], dtype=object)},
              1: {"x": np.ones((2, 3)), "text": np.array(["c", "d"], dtype=object)}}
    monkeypatch.setattr(source, "_block", lambda b: blocks[b])
    with pytest.raises(BadSample, match=r"column 'text' cannot be a tensor: TypeError") as err:
        source.fetch(np.array([0, 1]), 0)
    assert err.value.sample == "rows 0..1 (Ray Data block 0)"
    blocks = {0: {"x": np.ones((2, 3))}, 1: {"y": np.ones(2)}}
    with pytest.raises(BadSample, match=r"no column 'x', which block 0 has") as err:
        source.fetch(np.array([1, 2]), 0)
    assert err.value.sample == "rows 2..3 (Ray Data block 1)"


def test_a_hugging_face_iterable_dataset_is_refused_in_one_line_naming_the_alternatives():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"x": list(range(10))}).to_iterable_dataset()
    with pytest.raises(WorkloadRefused) as err:
        source_for(data, 0)
    message = str(err.value)
    assert "\n" not in message and "IterableDataset" in message
    assert all(word in message for word in ("map-style datasets.Dataset", "token shards", "Ray Data"))


# ------------------------------------------------------------------ the loader's threads
class Reentry(torch.utils.data.Dataset):
    """Sees whether two threads are inside `__getitem__` at once: the first read waits (at most 1 s) for
    another to come in."""

    def __init__(self, thread_safe: bool = False) -> None:
        if thread_safe:
            self.thread_safe = True
        self.inside = 0
        self.overlapped = False
        self._lock = threading.Lock()
        self._first, self._second = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        with self._lock:
            self.inside += 1
            if self.inside > 1:
                self.overlapped = True
                self._second.set()
            waits = not self._first.is_set()
            self._first.set()
        if waits:
            self._second.wait(1.0)
        with self._lock:
            self.inside -= 1
        return torch.tensor([float(i)])


@pytest.mark.parametrize("thread_safe", [False, True])
def test_loader_threads_never_enter_a_datasets_getitem_together_unless_it_says_it_may(thread_safe):
    data = Reentry(thread_safe)
    source = MapSource(data, 0)
    loader = BatchLoader(workers=2, prefetch=2)
    try:
        loader.ahead([(k, lambda k=k: source.fetch(np.array([2 * k, 2 * k + 1]), 0)) for k in range(2)])
        assert [loader.take(k).batch.view(-1).tolist() for k in range(2)] == [[0.0, 1.0], [2.0, 3.0]]
    finally:
        loader.close()
    assert data.overlapped == thread_safe


def test_the_clis_summary_counts_the_samples_skipped(capsys):
    from orchestrator.cli import ProgressPrinter, format_status

    status = JobStatus(name="j", run_id="r", state="FINISHED", step=10, membership_epoch=1, world_size=3, members=(),
                       loss=0.5, throughput=None, cause=None, run_dir="/tmp/r", samples_skipped=2)
    ProgressPrinter(10, 1.0).summary(status, 3.0)
    assert "  bad samples skipped: 2 (workload.on_bad_sample: skip" in capsys.readouterr().out
    assert "bad samples skipped: 2" in format_status(status)
