"""Results as a Ray Train user expects them, in process (real replicas in threads over in-process gloo):
the workload's loss may return step metrics beside the loss, and history holds each one as the
sample-weighted mean over the step's global batch, computed here from the samples each member applied;
`load_model(run_dir)` rebuilds the final model from the run's factory; the progress line, the exported
metrics and TensorBoard show the step metrics; a metric that is not a number is named in one line."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

from actors.observe.metrics import Exporter, JobMetrics
from actors.runs import runfiles
from actors.runs.storage import open_storage
from actors.training.workload import split_loss
from core.schema import JobStatus
from orchestrator import JobResult, load_model
from orchestrator.cli import ProgressPrinter
from testkit.fake_workers import FakeMetric
from testkit.harness import LocalJob, committed_samples

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
SLOTS = ["w0", "w1", "w2"]
GLOBAL_BATCH = 10  # not divisible by 3: the members' shares differ (4, 3, 3)


def label(sample: int) -> int:
    """The label of training sample `sample` in tests/workloads/custom_workload.py."""
    return sample % 4


def config(name: str, metrics: str, steps: int = 12, **over) -> dict:
    return {"name": name, "seed": 3, "workers": {"count": len(SLOTS), "cpus": 0.3},
            "workload": {"factory": "custom_workload:make", "params": {"metrics": metrics}, "batch_size": 4},
            "optimizer": {"name": "sgd", "lr": 0.1}, "stop": {"max_steps": steps}, "eval_every": 0,
            "faults": {"record_samples": True}, **over}


@pytest.fixture(autouse=True)
def _workloads_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(WORKLOADS))


@pytest.mark.parametrize("form", ["tuple", "dict", "float"])
def test_a_step_metric_is_the_sample_weighted_mean_over_the_global_batch(tmp_path, form):
    """`mean_label` is the mean of a batch's labels: over the global batch it is the mean of the labels of
    every sample the members applied at that step, however the batch was split among them."""
    job = LocalJob(config(f"metrics-{form}", form), SLOTS, str(tmp_path))
    job.run(tuple(SLOTS), GLOBAL_BATCH)
    history = job.link.records
    applied = committed_samples(tmp_path, history)
    assert [r["step"] for r in history] == list(range(1, 13))
    unweighted_differs = False
    for record in history:
        ids = applied[record["step"]]
        assert len(ids) == GLOBAL_BATCH
        reference = sum(label(i) for i in ids) / len(ids)
        assert record["step_metrics"]["mean_label"] == pytest.approx(reference, abs=1e-6), record
        assert 0.0 <= record["step_metrics"]["accuracy"] <= 1.0
        shares = [[int(i) for i in line.split()[2:]] for slot in SLOTS
                  for line in (tmp_path / "samples" / f"{slot}.txt").read_text().splitlines()
                  if int(line.split()[0]) == record["step"]]
        members_mean = sum(sum(map(label, s)) / len(s) for s in shares) / len(shares)
        unweighted_differs |= abs(members_mean - reference) > 1e-3
    assert unweighted_differs, "the members' unweighted mean equals the weighted one at every step: the test sees no weights"


def test_load_model_rebuilds_the_final_model_from_the_factory(tmp_path):
    """The run folder as a job leaves it (its `config.yaml` and the final state in `model.pt`): the model
    comes back from the factory with the final weights, not with the factory's initial ones."""
    job = LocalJob(config("load", "tuple", steps=8), SLOTS, str(tmp_path))
    job.run(tuple(SLOTS), GLOBAL_BATCH)
    final = job.parameters("w0")
    files = {"config.yaml": yaml.safe_dump(job.config, sort_keys=False).encode(),
             "model.pt": job.replicas["w0"].final_state()}  # what the job's end writes (rank 0's state)
    remote = open_storage(f"memory://results-{tmp_path.name}/runs/load/r")  # the run's copy on its storage
    for name, data in files.items():
        runfiles.write_bytes_atomic(tmp_path / name, data)
        remote.write(name, data)
    for model in (load_model(tmp_path), load_model(str(tmp_path)), load_model(remote.uri),
                  JobResult(name="load", run_id="r", state="FINISHED", step=8, cause=None, metrics={},
                            run_dir=str(tmp_path), elapsed_s=1.0).model()):
        loaded = [p.detach() for p in model.parameters()]
        assert len(loaded) == len(final) and all(torch.equal(a, b) for a, b in zip(loaded, final))
    state = torch.load(io.BytesIO((tmp_path / "model.pt").read_bytes()), weights_only=True)
    assert state["metric_names"] == ["accuracy", "mean_label"]
    with pytest.raises(Exception, match="model.pt"):
        load_model(tmp_path / "nowhere")


def test_a_member_that_takes_a_state_carries_its_step_metrics_before_its_first_loss(tmp_path):
    """A joiner (or a resume) takes the committed state before it computes any loss: its vote is sized for
    the state's step metrics from its first collective (a periodic round may come before its first step)."""
    job = LocalJob(config("state", "tuple", steps=3), ["w0"], str(tmp_path / "a"))
    job.run(("w0",), 4)
    fresh = LocalJob(config("state", "tuple", steps=3), ["w0"], str(tmp_path / "b")).replicas["w0"]
    assert fresh.policy.impl.vote_extras == 0
    fresh.load_checkpoint(job.replicas["w0"].final_state())
    assert (fresh.metrics.names, fresh.policy.impl.vote_extras) == (("accuracy", "mean_label"), 2)


def test_a_step_metric_that_is_not_a_number_is_named_in_one_line():
    loss = torch.tensor(1.0, requires_grad=True)
    assert split_loss(loss) == (loss, {})
    for returned, named in (((loss, {"quality": "high"}), "step metric 'quality' as a str"),
                            ((loss, {"scores": torch.ones(3)}), "step metric 'scores' as a torch.float32 tensor of shape (3,)"),
                            ({"acc": 1.0}, "without a 'loss' key"),
                            ((loss, 0.5), "tuple of 2 (Tensor, float)")):
        with pytest.raises(TypeError) as caught:
            split_loss(returned)
        assert named in str(caught.value) and "\n" not in str(caught.value)


def _status(**over) -> JobStatus:
    fields = dict(name="j", run_id="r", state="RUNNING", step=3, membership_epoch=1, world_size=3, members=(),
                  loss=0.5, throughput=2.0, cause=None, run_dir="/runs/j/r")
    return JobStatus(**(fields | over))


def test_the_progress_line_and_the_summary_show_the_step_metrics(capsys):
    printer = ProgressPrinter(10, 0.0)
    printer(_status(step_metrics={"mean_label": 1.5, "accuracy": 0.25}))
    printer.summary(_status(state="FINISHED", step_metrics={"mean_label": 1.5}), 1.0)
    out = capsys.readouterr().out
    assert "step 3/10 loss 0.5000 accuracy 0.2500 mean_label 1.5000 steps/s" in out
    assert "step metrics of the last step: mean_label 1.5000" in out


def test_the_exported_metrics_carry_each_step_metric():
    made: dict[str, FakeMetric] = {}
    exporter = Exporter("j", "r", "bsp", make=lambda metric, _: made.setdefault(metric.name, FakeMetric(metric.kind)))
    metrics = JobMetrics(exporter, "gradients", lambda: 1)
    metrics.record({"step": 1, "time": 1.0, "loss": 0.5, "step_metrics": {"mean_label": 1.5, "accuracy": 0.25}})
    metrics.flush()
    assert made["step_metric"].values == {(("metric", "accuracy"),): 0.25, (("metric", "mean_label"),): 1.5}


def test_tensorboard_writes_each_step_metric_under_train(tmp_path):
    pytest.importorskip("tensorboardX", reason="tracking.tensorboard needs tensorboardX (the [tracking] extra)")
    from test_tensorboard import record, scalars

    from actors.observe.tracking import TensorBoard

    board = TensorBoard(tmp_path, per_member=False)
    for step in (1, 2):
        board.record(record(step, step_metrics={"mean_label": 1.0 + step}))
    board.close()
    assert scalars(tmp_path)["train/mean_label"] == [(1, 2.0), (2, 3.0)]
