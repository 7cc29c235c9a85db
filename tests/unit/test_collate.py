"""A workload's `collate_fn`: each share's samples, in order, to the batch its `loss` takes, in place of torch's
`default_collate`, for map-style data, streams and Ray Data shares (one dict per row, string columns as stored);
what it raises is the workload's bug. Real replicas in threads train on text only a collate_fn can batch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.training.sources import BlockSource, MapSource, StreamSource
from actors.training.user_code import WorkloadBug
from core.workload_api import Workload
from testkit.harness import LocalJob

WORDS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g", "hh"]


class Texts(torch.utils.data.Dataset):
    """(a word of 1-6 letters, its length - 1): ragged strings, which `default_collate` cannot batch."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[str, int]:
        word = WORDS[i % len(WORDS)]
        return word, len(word) - 1


def pad_bytes(samples: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The words' bytes, zero-padded to 6, as float32, and their labels."""
    x = torch.zeros(len(samples), 6)
    for row, (word, _) in enumerate(samples):
        x[row, :len(word)] = torch.tensor(list(word.encode()), dtype=torch.float32) / 255
    return x, torch.tensor([label for _, label in samples])


def text_workload(collate: bool = True) -> Workload:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6)
    return Workload(model=model, train_data=Texts(), collate_fn=pad_bytes if collate else None,
                    loss=lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1]))


def test_a_map_style_share_goes_to_the_collate_fn_in_order():
    seen: list[list] = []
    source = MapSource(Texts(), seed=0, collate=lambda samples: seen.append(samples) or len(samples))
    ids = source.global_batch(0, 5)
    assert source.fetch(ids, 0).batch == 5
    assert seen == [[Texts()[i] for i in ids.tolist()]]


def test_without_a_collate_fn_the_words_stay_strings_and_with_one_they_are_a_padded_tensor():
    """The mechanism off: torch's default_collate leaves the words strings, which no model takes."""
    plain = MapSource(Texts(), seed=0).fetch(np.arange(4), 0).batch
    assert list(plain[0]) == ["a", "bb", "ccc", "dddd"] and all(isinstance(w, str) for w in plain[0])
    x, y = MapSource(Texts(), seed=0, collate=pad_bytes).fetch(np.arange(4), 0).batch
    assert x.shape == (4, 6) and y.tolist() == [0, 1, 2, 3]


def test_a_tensor_dataset_goes_through_the_collate_fn_too():
    data = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    batch = MapSource(data, seed=0, collate=lambda samples: [s[1].item() for s in samples]).fetch(np.arange(3), 0).batch
    assert batch == [0, 1, 2]


def test_what_the_collate_fn_raises_is_the_workloads_bug_named_collate_fn():
    def broken(samples: list) -> None:
        raise ValueError("cannot pad")

    with pytest.raises(WorkloadBug) as caught:
        MapSource(Texts(), seed=0, collate=broken).fetch(np.arange(2), 0)
    assert caught.value.fault.kind == "collate_fn" and "cannot pad" in caught.value.fault.line


def test_a_streams_items_go_to_the_collate_fn():
    class Stream:
        def __init__(self) -> None:
            self.at = 0

        def __iter__(self):
            while self.at < 20:
                self.at += 1
                yield {"text": WORDS[self.at % len(WORDS)]}

        def state_dict(self) -> dict:
            return {"at": self.at}

        def load_state_dict(self, state: dict) -> None:
            self.at = state["at"]

    batch = StreamSource(Stream(), collate=lambda items: [item["text"] for item in items]).fetch(np.arange(3), 0).batch
    assert batch == ["bb", "ccc", "dddd"]


def test_a_ray_data_share_reaches_the_collate_fn_as_one_dict_a_row_strings_included(monkeypatch):
    """Two blocks of 3 rows (an int column and a string column): the share's rows, in the share's order."""
    blocks = {0: {"id": np.arange(3), "text": np.array(["a", "bb", "ccc"], dtype=object)},
              1: {"id": np.arange(3, 6), "text": np.array(["dddd", "e", "ff"], dtype=object)}}
    source = BlockSource([("ref0", 3), ("ref1", 3)], seed=0, collate=lambda rows: rows)
    monkeypatch.setattr(source, "_block", lambda b: blocks[b])
    ids = source.global_batch(0, 6)
    rows = source.fetch(ids, 0).batch
    assert [int(r["id"]) for r in rows] == ids.tolist()
    assert {r["text"] for r in rows} == {"a", "bb", "ccc", "dddd", "e", "ff"}


def test_replicas_train_text_batched_by_the_collate_fn(tmp_path, monkeypatch):
    """Two replicas in threads, bsp: every step's share is the padded words, and the steps commit."""
    import actors.training.replica as replica

    monkeypatch.setattr(replica, "build_workload", lambda cfg: text_workload())
    cfg = {"name": "collate", "seed": 0, "workers": {"count": 2, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 4},
           "optimizer": {"name": "sgd", "lr": 0.5}, "sync": {"policy": "bsp", "engine": "python"},
           "stop": {"max_steps": 6}, "eval_every": 0}
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 8)
    assert [r["step"] for r in job.link.records] == list(range(1, 7))
    assert all(r["loss"] > 0 for r in job.link.records)
