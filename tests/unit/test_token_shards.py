"""Token shards (orchestrator/data/shards.py): a directory or storage prefix of `.bin` / `.npy` token
files read as one map-style dataset of windows, by range, without loading a shard; a truncated shard
fails with its name. The reference is written from the definition: shard by shard, in name order,
windows of seq_len + 1 tokens starting every seq_len tokens, none crossing a shard's end."""
from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from actors.runs.storage import open_storage
from orchestrator.data.shards import TokenShards


def write_shards(folder, sizes, dtype=np.uint16, kinds=("bin", "npy")):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = []
    for i, size in enumerate(sizes):
        tokens = rng.integers(0, 50_000, size=size).astype(dtype)
        arrays.append(tokens)
        kind = kinds[i % len(kinds)]
        if kind == "bin":
            (folder / f"shard-{i:03d}.bin").write_bytes(tokens.tobytes())
        else:
            np.save(folder / f"shard-{i:03d}.npy", tokens)
    return arrays


def reference_windows(arrays, seq_len):
    rows = []
    for tokens in arrays:
        for start in range(0, len(tokens) - seq_len, seq_len):
            rows.append(tokens[start:start + seq_len + 1].astype(np.int64))
    return rows


def test_windows_are_every_shards_own_in_name_order(tmp_path):
    arrays = write_shards(tmp_path / "shards", [1000, 17, 513, 64])
    data = TokenShards(str(tmp_path / "shards"), seq_len=32, dtype="uint16")
    expected = reference_windows(arrays, 32)
    assert len(data) == len(expected)
    for i in (0, 1, len(expected) // 2, len(expected) - 1):
        (row,) = data[i]
        assert row.dtype == torch.int64 and torch.equal(row, torch.from_numpy(expected[i])), i
    assert [data.where(i)[0] for i in (0, len(expected) - 1)] == ["shard-000.bin", "shard-003.npy"]


def test_a_remote_prefix_reads_the_same_windows_by_range(tmp_path):
    local = tmp_path / "shards"
    arrays = write_shards(local, [700, 300])
    store = open_storage(f"memory://bucket-{uuid.uuid4().hex[:8]}/tokens")
    for path in sorted(local.iterdir()):
        store.write(f"train/{path.name}", path.read_bytes())
    data = TokenShards(store.location("train"), seq_len=16, dtype="uint16")
    expected = reference_windows(arrays, 16)
    assert len(data) == len(expected)
    for i in range(len(expected)):
        assert torch.equal(data[i][0], torch.from_numpy(expected[i]))


def test_a_truncated_shard_fails_with_its_name(tmp_path):
    write_shards(tmp_path / "shards", [100, 100], kinds=("bin",))
    path = tmp_path / "shards" / "shard-001.bin"
    path.write_bytes(path.read_bytes()[:-1])  # half a uint16 token
    with pytest.raises(ValueError, match=r"shard-001\.bin.*199 bytes.*not a whole number of uint16 tokens"):
        TokenShards(str(tmp_path / "shards"), seq_len=8, dtype="uint16")
    write_shards(tmp_path / "npy", [100], kinds=("npy",))
    npy = tmp_path / "npy" / "shard-000.npy"
    npy.write_bytes(npy.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"shard-000\.npy.*truncated"):
        TokenShards(str(tmp_path / "npy"), seq_len=8)


def test_no_shards_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .bin or .npy token shards"):
        TokenShards(str(tmp_path / "empty"), seq_len=8)


def test_the_language_model_trains_on_token_shards(tmp_path):
    """`orchestrator.workloads.lm:gpt` with `shards`: the model's vocabulary is the tokens', and a step on
    a batch of windows lowers the loss on that batch (the windows reach the model as inputs and targets)."""
    from orchestrator.workloads.lm import gpt

    write_shards(tmp_path / "train", [2000, 1500], dtype=np.uint16)
    write_shards(tmp_path / "held", [600], dtype=np.uint16)
    work = gpt(size="tiny", d_model=32, n_layer=1, n_head=2, seq_len=16, shards=str(tmp_path / "train"),
               eval_shards=str(tmp_path / "held"), eval_count=8, vocab=50_000)
    assert work.model.tok.num_embeddings == 50_000 and len(work.eval_data) == 8
    batch = torch.utils.data.default_collate([work.train_data[i] for i in range(8)])
    optimizer = torch.optim.AdamW(work.model.parameters(), lr=1e-2)
    before = float(work.loss(work.model, batch).detach())
    for _ in range(5):
        optimizer.zero_grad()
        work.loss(work.model, batch).backward()
        optimizer.step()
    assert float(work.loss(work.model, batch).detach()) < before
    assert "eval_loss" in work.evaluate(work.model, work.eval_data)
