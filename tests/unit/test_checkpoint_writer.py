"""Rank 0's checkpoints written off the step loop (actors/training/checkpoint_writer.py): the state is
copied at the checkpoint's step and serialized in a thread while training goes on; the bytes are the
state of that step, not of a later one; one write at a time; a write's error reaches the step loop.
Replicas run in threads of this process (testkit/in_process.py); the first background write's
serialization (`torch.save` in the writer's thread) waits until the test lets it go on."""
from __future__ import annotations

import threading

import pytest
import torch

from actors.training.checkpoint_writer import Checkpoint, CheckpointWriter, host_copy
from actors.training.training_state import read_state
from testkit.harness import LocalJob

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def config(background: bool, steps: int = 12) -> dict:
    return {"name": "ckpt", "seed": 3, "workers": {"count": 2, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 16},
            "optimizer": SGD, "sync": {"policy": "bsp"}, "stop": {"max_steps": steps}, "eval_every": 0,
            "checkpoint": {"every_steps": 5, "background": background}}


class RecordingLink:
    """Records each checkpoint's bytes and, as each report arrives, its steps."""

    def __init__(self, link) -> None:
        self._link = link
        self.blobs: dict[int, bytes] = {}
        self.steps: list[int] = []
        self.reached = threading.Condition()

    def __getattr__(self, name):
        return getattr(self._link, name)

    def report(self, progress, wait):
        self._link.report(progress, wait)
        with self.reached:
            self.steps.extend(r["step"] for r in progress.records)
            self.reached.notify_all()

    def save_checkpoint(self, step: int, blob: bytes) -> None:
        self.blobs[step] = blob


def run(tmp_path, monkeypatch, background: bool, hold: bool = False) -> RecordingLink:
    links: list[RecordingLink] = []
    started, release = threading.Event(), threading.Event()
    save = torch.save

    def held_save(obj, f, *args, **kw):
        if threading.current_thread().name.startswith("checkpoint") and not release.is_set():
            started.set()
            assert release.wait(60), "the test never let the first write go on"
        return save(obj, f, *args, **kw)

    if hold:
        monkeypatch.setattr(torch, "save", held_save)
    job = LocalJob(config(background), ["w0", "w1"], str(tmp_path / str(background)),
                   wrap_link=lambda link: links.append(RecordingLink(link)) or links[-1])
    link = links[0]  # w0's: rank 0
    job.publish(("w0", "w1"), 1, 32)
    job.start()
    if hold:
        assert started.wait(60)
        with link.reached:  # training goes on past the checkpoint while its write waits
            assert link.reached.wait_for(lambda: max(link.steps, default=0) >= 9, 60), link.steps
        assert not link.blobs  # step 5's checkpoint is not serialized yet
        release.set()
    outcomes = job.wait()
    assert all(o.ok for o in outcomes.values()), outcomes
    return link


def test_a_background_checkpoint_holds_its_own_steps_state_while_training_goes_on(tmp_path, monkeypatch):
    synchronous = run(tmp_path, monkeypatch, background=False)
    held = run(tmp_path, monkeypatch, background=True, hold=True)
    assert sorted(held.blobs) == sorted(synchronous.blobs) == [5, 10]
    for step in (5, 10):
        a, b = read_state(synchronous.blobs[step]), read_state(held.blobs[step])
        assert a["step"] == b["step"] == step
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), step  # step 5's, not step 9's
        assert a["cursor"] == b["cursor"]


def test_a_synchronous_checkpoint_holds_the_step_loop():
    """The mechanism switched off (`background: false`): the save runs on the caller's thread."""
    seen: list[str] = []
    writer = CheckpointWriter(lambda step, blob: seen.append(threading.current_thread().name))
    writer.submit(5, Checkpoint(lambda: b"x", background=False))
    assert seen == [threading.current_thread().name]
    writer.submit(10, Checkpoint(lambda: b"y", background=True))
    writer.wait()
    assert seen[1] == "checkpoint 10" and writer.written == [5, 10]


def test_one_write_at_a_time_and_its_error_reaches_the_next_checkpoint():
    order: list[str] = []
    gate = threading.Event()

    def save(step: int, blob: bytes) -> None:
        order.append(f"save {step}")
        if step == 5:
            assert gate.wait(30)
            raise ConnectionError("the coordinator is gone")

    writer = CheckpointWriter(save)
    writer.submit(5, Checkpoint(lambda: b"x", background=True))
    assert writer.writing
    gate.set()
    with pytest.raises(ConnectionError, match="coordinator is gone"):
        writer.submit(10, Checkpoint(lambda: b"y", background=True))  # waits for step 5's write first
    assert order == ["save 5"] and writer.written == []


def test_the_host_copy_is_a_copy_with_the_states_structure():
    model = torch.nn.Linear(2, 1).state_dict()  # an OrderedDict with `_metadata`, as a synchronous checkpoint saves it
    live = {"model": model, "step": 5, "rng": [torch.zeros(2)], "name": "x"}
    copied, done = host_copy(live)
    assert done is None  # nothing was on a GPU
    before = model["weight"].clone()
    model["weight"].add_(1)
    assert torch.equal(copied["model"]["weight"], before) and copied["step"] == 5 and copied["name"] == "x"
    assert isinstance(copied["rng"], list) and torch.equal(copied["rng"][0], torch.zeros(2))
    assert type(copied["model"]) is type(model) and copied["model"]._metadata == model._metadata
