"""Token shards (orchestrator/data/shards.py): a directory or storage prefix of `.bin` / `.npy` token
files read as one map-style dataset of windows, by range, without loading a shard; a truncated shard
fails with its name. The reference is written from the definition: shard by shard, in name order,
windows of seq_len + 1 tokens starting every seq_len tokens, none crossing a shard's end."""
from __future__ import annotations

import re
import uuid

import numpy as np
import pytest
import torch

from actors.runs.storage import open_storage
from actors.training.sources import BadSample, MapSource
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


def test_a_shard_of_non_integer_tokens_is_refused(tmp_path):
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "shard-000.npy", np.arange(100, dtype=np.float32))
    with pytest.raises(ValueError, match=r"shard-000\.npy has float32 tokens; token ids are integers"):
        TokenShards(str(tmp_path / "npy"), seq_len=8)
    write_shards(tmp_path / "bin", [100], kinds=("bin",))
    with pytest.raises(ValueError, match=r"dtype='float16' has float16 tokens; token ids are integers"):
        TokenShards(str(tmp_path / "bin"), seq_len=8, dtype="float16")


def test_a_file_whose_size_is_not_what_its_header_says_is_refused(tmp_path):
    """A `.npy` with bytes past its array, and an llm.c `.bin` (its 1,024-byte header: magic 20240520,
    version 1 for uint16, the token count) truncated to a whole number of tokens, which a raw shard's
    size cannot show. An llm.c shard that is whole is read after its header."""
    write_shards(tmp_path / "npy", [100], kinds=("npy",))
    npy = tmp_path / "npy" / "shard-000.npy"
    npy.write_bytes(npy.read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match=r"shard-000\.npy has \d+ bytes, but its header says 100 tokens"):
        TokenShards(str(tmp_path / "npy"), seq_len=8)
    tokens = np.arange(1, 201, dtype=np.uint16)
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, len(tokens))
    (tmp_path / "llmc").mkdir()
    shard = tmp_path / "llmc" / "train-000.bin"
    shard.write_bytes(header.tobytes() + tokens.tobytes())
    data = TokenShards(str(tmp_path / "llmc"), seq_len=8, dtype="uint16")
    assert len(data) == (200 - 1) // 8 and data[0][0].tolist() == list(range(1, 10))
    shard.write_bytes(header.tobytes() + tokens[:150].tobytes())
    with pytest.raises(ValueError, match=r"train-000\.bin has 1324 bytes, but its llm\.c header says 200 uint16 "
                                         r"tokens \(1424 bytes\): truncated\?"):
        TokenShards(str(tmp_path / "llmc"), seq_len=8)


def test_a_token_outside_the_vocabulary_is_a_bad_sample_naming_it(tmp_path):
    (tmp_path / "shards").mkdir()
    tokens = np.arange(64, dtype=np.int32)
    tokens[20], tokens[45] = 70_000, -5
    np.save(tmp_path / "shards" / "shard-000.npy", tokens)
    data = TokenShards(str(tmp_path / "shards"), seq_len=8, vocab=50_000)
    assert data[0][0].tolist() == list(range(9))
    with pytest.raises(ValueError, match=r"shard-000\.npy has token id 70000 at token 20, outside the vocabulary "
                                         r"\[0, 50000\)"):
        data[2]
    with pytest.raises(BadSample, match=r"training sample 5 could not be read: ValueError: .*token id -5 at token 45"):
        MapSource(data, 0).fetch(np.array([0, 5]), 0)


TRUNCATE_WHILE_READING = """
import sys
import numpy as np
from actors.training.sources import BadSample, MapSource
from orchestrator.data.shards import TokenShards

source = MapSource(TokenShards(sys.argv[1], seq_len=64), 0)
last = np.array([len(source.data) - 1])
source.fetch(last, 0)  # the shard is open (a memory map held it mapped)
with open(sys.argv[2], "r+b") as f:
    f.truncate(1000)
try:
    source.fetch(last, 0)
except BadSample as err:
    print(err)
"""


def test_a_shard_truncated_while_training_is_a_bad_sample_not_a_sigbus(tmp_path):
    """In a process of its own: with the shard memory-mapped, the read after the truncation killed the
    process with SIGBUS (-7), which the coordinator took for a worker's death."""
    import subprocess
    import sys
    from pathlib import Path

    write_shards(tmp_path / "shards", [10_000], kinds=("bin",))
    done = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_READING, str(tmp_path / "shards"),
                           str(tmp_path / "shards" / "shard-000.bin")], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert re.search(r"training sample 155 could not be read: ValueError: token shards: .*shard-000\.bin held 10000 "
                     r"tokens when opened, but now ends before token 9985, which sample 155 needs", done.stdout), done.stdout
