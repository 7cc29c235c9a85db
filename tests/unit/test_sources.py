"""Data sources (actors/training/sources.py): each source's order against a reference written from its
definition in docs/data.md, positioning, refusals and bad samples; then whole runs of replicas in
threads of this process (testkit's LocalJob) that check the sample ledger."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.training.sources import ArrowSource, BadSample, BlockOrder, MapSource, StreamSource, source_for
from algorithms.rules.kinds import SERVER
from algorithms.rules.sampler import split_for_rank
from core.schema import WorkloadRefused
from orchestrator.workloads.digits_sources import BadSamples, DigitsStream
from testkit.harness import LocalJob


def test_a_ray_data_epoch_visits_blocks_in_a_seeded_permutation_rows_in_block_order():
    """docs/data.md: data epoch e orders the blocks by numpy's permutation drawn from (seed, e); each
    block's rows follow in order; a row's id is its position in the materialized dataset."""
    rows = [3, 1, 4, 2]
    starts = [0, 3, 4, 8]
    order = BlockOrder(rows, seed=9)
    for epoch in (0, 1):
        blocks = np.random.default_rng([9, epoch]).permutation(4)
        expected = [starts[b] + r for b in blocks for r in range(rows[b])]
        assert order.global_batch(epoch * 10, 10).tolist() == expected
    assert sorted(order.global_batch(0, 10).tolist()) == list(range(10))
    assert order.global_batch(8, 4).tolist() == order.global_batch(8, 2).tolist() + order.global_batch(10, 2).tolist()


def stream(n: int = 10, positioned: bool = True) -> DigitsStream:
    return DigitsStream(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n), positioned)


def shares(source, cursor: int, size: int, world: int) -> list[list[int]]:
    ids = source.global_batch(cursor, size)
    return [source.fetch(split_for_rank(ids, r, world), cursor).ids.tolist() for r in range(world)]


def test_a_stream_is_read_in_order_each_member_keeping_its_share_across_data_epochs():
    source = StreamSource(stream(10))
    got = [shares(source, c, 4, 2) for c in (0, 4, 8)]
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [0, 1]]]  # position 10 is sample 0 of epoch 1
    assert source.fetch(np.array([9]), 8).batch["x"].tolist() == [[9.0]]


def test_a_stream_goes_back_to_the_committed_position_and_a_new_member_starts_there():
    source = StreamSource(stream(10))
    shares(source, 0, 4, 2)
    source.committed(4)  # step 1 committed
    shares(source, 4, 4, 2)  # step 2 trained, never committed: redone
    assert shares(source, 4, 4, 2) == [[4, 5], [6, 7]]
    state = source.state_dict()
    assert state["position"] == 4
    joiner = StreamSource(stream(10))  # a fresh replica (a join, a restart, --resume) loads the committed state
    joiner.load_state_dict(state)
    assert shares(joiner, 4, 6, 3) == [[4, 5], [6, 7], [8, 9]]


def test_the_mechanism_off_a_stream_that_ignores_its_state_restarts_at_zero():
    """What a stream without positioning would do (the e2e test's mechanism switched off)."""
    source = StreamSource(stream(10))
    shares(source, 0, 4, 2)
    source.committed(4)
    joiner = StreamSource(stream(10, positioned=False))
    joiner.load_state_dict(source.state_dict())
    assert shares(joiner, 4, 2, 1) == [[0, 1]]  # its ids (the samples' own) show the repeat


def test_an_iterable_that_cannot_be_positioned_is_refused_in_one_line():
    def gen():
        yield from range(3)

    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    for data in (gen(), Plain()):
        with pytest.raises(WorkloadRefused, match="without state_dict") as err:
            source_for(data, 0)
        assert "\n" not in str(err.value)
    with pytest.raises(WorkloadRefused, match="cannot deal from"):
        source_for(stream(), 0, kind=SERVER)
    assert isinstance(source_for(stream(), 0), StreamSource)


def test_a_bad_sample_fails_with_its_id_or_is_skipped_and_reported():
    x, y = torch.zeros(6, 2), torch.arange(6)
    data = BadSamples(x, y, bad=[4])
    with pytest.raises(BadSample, match="training sample 4 could not be read: ValueError: corrupt record 4"):
        MapSource(data, 0).fetch(np.array([1, 4, 5]), 0)
    fetched = MapSource(data, 0, skip_bad=True).fetch(np.array([1, 4, 5]), 0)
    assert fetched.ids.tolist() == [1, 5] and fetched.skipped == [4] and fetched.batch[1].tolist() == [1, 5]
    with pytest.raises(BadSample, match="every sample"):
        MapSource(data, 0, skip_bad=True).fetch(np.array([4]), 0)


def test_a_hugging_face_dataset_is_read_in_the_global_order_by_one_batched_take():
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"id": list(range(20)), "x": [[float(i)] for i in range(20)]})
    source = source_for(table, seed=4)
    assert isinstance(source, ArrowSource)
    expected = np.random.default_rng([4, 0]).permutation(20)  # the global sampler's definition
    ids = source.global_batch(0, 6)
    assert ids.tolist() == expected[:6].tolist()
    batch = source.fetch(ids, 0).batch
    assert batch["id"].tolist() == ids.tolist() and batch["x"][:, 0].tolist() == [float(i) for i in ids]


def ledger_ids(run_dir, slots) -> list[int]:
    ids = []
    for slot in slots:
        for line in (run_dir / "samples" / f"{slot}.txt").read_text().splitlines():
            ids += [int(v) for v in line.split()[2:]]
    return ids


@pytest.mark.parametrize("source", ["stream", "datasets"])
def test_two_replicas_train_each_sample_of_the_epoch_once(tmp_path, source):
    """The digits training split is 1437 samples: 89 steps of 16 hold 1424 of epoch 0."""
    if source == "datasets":
        pytest.importorskip("datasets")
    cfg = {"name": "sources", "seed": 3, "workers": {"count": 2, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits_sources:mlp", "params": {"source": source, "hidden": 8},
                        "batch_size": 8, "loader": {"workers": 1, "prefetch": 2}},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 89}, "eval_every": 0, "faults": {"record_samples": True}}
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 16)
    ids = ledger_ids(tmp_path, ("w0", "w1"))
    assert len(ids) == len(set(ids)) == 89 * 16 and max(ids) < 1437


def test_skipped_samples_are_reported_and_the_rest_trained(tmp_path):
    cfg = {"name": "skip", "seed": 3, "workers": {"count": 2, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits_sources:mlp",
                        "params": {"source": "bad_samples", "hidden": 8, "bad": [5, 700]}, "batch_size": 8,
                        "on_bad_sample": "skip"},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 89}, "eval_every": 0, "faults": {"record_samples": True}}
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 16)
    ids = ledger_ids(tmp_path, ("w0", "w1"))
    skipped = [args[2] for name, args in job.link.calls if name == "samples_skipped"]
    assert sorted(i for s in skipped for i in s) == [5, 700]
    assert len(ids) == len(set(ids)) == 89 * 16 - 2 and not {5, 700} & set(ids)


def test_without_skip_a_bad_sample_fails_the_step_with_its_id(tmp_path):
    cfg = {"name": "bad", "seed": 3, "workers": {"count": 1, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits_sources:mlp",
                        "params": {"source": "bad_samples", "hidden": 8, "bad": list(range(1437))}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 5}, "eval_every": 0}
    job = LocalJob(cfg, ["w0"], str(tmp_path))
    job.publish(("w0",), 1, 8)
    job.start()
    outcome = job.wait()["w0"]
    assert not outcome.ok and outcome.error.startswith("BadSample: training sample ")
    assert "could not be read: ValueError: corrupt record" in outcome.error


def test_a_joiner_and_a_resume_continue_a_stream_where_the_committed_state_left_it(tmp_path):
    """The state a joiner receives (and a checkpoint holds) carries the stream's own state at the
    committed cursor: a fresh replica that loads it reads on from there. With a stream that ignores the
    state it is given (`positioned: false`, the mechanism switched off), it starts over at id 0."""
    def stream_job(name: str, slot: str, positioned: bool = True) -> LocalJob:
        cfg = {"name": "stream", "seed": 3, "workers": {"count": 1, "cpus": 1},
               "workload": {"factory": "orchestrator.workloads.digits_sources:mlp",
                            "params": {"source": "stream", "hidden": 8, "positioned": positioned}, "batch_size": 6},
               "optimizer": {"lr": 0.05}, "stop": {"max_steps": 7}, "eval_every": 0}
        return LocalJob(cfg, [slot], str(tmp_path / name))

    first = stream_job("first", "w0")
    first.run(("w0",), 6)
    blob = first.replicas["w0"].committed.state_bytes()
    for positioned, expected in ((True, list(range(42, 48))), (False, list(range(6)))):
        joiner = stream_job(f"joiner-{positioned}", "w1", positioned).replicas["w1"]
        joiner.committed.load_state_bytes(blob)
        assert joiner.training.cursor == 42
        assert joiner.feed.source.fetch(joiner.feed.source.global_batch(42, 6), 42).ids.tolist() == expected
