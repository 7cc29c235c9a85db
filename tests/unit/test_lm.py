"""The built-in language model (orchestrator/workloads/lm.py): its text is split by file and built
once into a shared memory-mapped file; its windows are views of that file; BSP on it equals
single-process training on the same global batches; its records count tokens."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orchestrator.workloads import lm
from testkit.harness import LocalJob
from tests.unit.test_policy_oracles import global_batch_ids

SEED, STEPS = 3, 20
SMALL = {"size": "tiny", "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16}


def test_the_text_is_split_by_file_and_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "stdlib"
    for i in range(60):
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"m{i}.py").write_bytes(f"# module {i}\n".encode() * (i + 1))
    (root / "test").mkdir()
    (root / "test" / "t.py").write_text("left out\n")
    lm.text_arrays.cache_clear()
    train, held = lm.text_arrays(str(root))
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if not p.relative_to(root).as_posix().startswith("test/"))
    expect_held = [r for r in rels if lm.held_out(r)]
    assert expect_held and len(expect_held) < len(rels)  # both sides have files
    assert bytes(held) == b"".join((root / r).read_bytes() for r in expect_held)
    assert bytes(train) == b"".join((root / r).read_bytes() for r in rels if r not in expect_held)
    built = sorted((tmp_path / "cache" / "elastic-orchestrator").iterdir())
    assert [p.name.rsplit(".", 2)[-2] for p in built] == ["eval", "train"], built  # no temporary file left
    mtimes = [p.stat().st_mtime_ns for p in built]
    lm.text_arrays.cache_clear()
    lm.text_arrays(str(root))  # a second build reads what the first wrote
    assert [p.stat().st_mtime_ns for p in built] == mtimes
    lm.text_arrays.cache_clear()


def test_training_windows_are_views_of_the_mapped_text():
    train, _ = lm.text_arrays()
    rows = lm.windows(train, 16)
    assert rows.untyped_storage().data_ptr() == train.ctypes.data  # no copy of the text
    assert torch.equal(rows[5], torch.from_numpy(np.array(train[80:97])))  # row i: bytes i*16 .. i*16+16
    assert torch.equal(rows[5][-1], rows[6][0])


def reference(global_batch: int, dtype: str) -> list[torch.Tensor]:
    """Single-process AdamW on the mean next-byte cross-entropy of each global batch, written from
    the model's definition: the loss of the whole batch at once."""
    torch.manual_seed(SEED)
    workload = lm.gpt(**SMALL, dtype=dtype)
    model = workload.model
    (rows,) = workload.train_data.tensors
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(STEPS):
        batch = rows[torch.tensor(global_batch_ids(step, global_batch, len(rows)))].long()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("dtype,bound", [("float32", 1e-5), ("float64", 1e-12)])
def test_bsp_on_the_language_model_equals_single_process_training(tmp_path, dtype, bound):
    """In float32 AdamW divides by the root of tiny second moments, which magnifies the rounding of a
    sum taken in two parts (8.7e-06 here); in float64 the two agree to rounding."""
    config = {"name": "lm", "seed": SEED, "workers": {"count": 2, "cpus": 1},
              "workload": {"factory": "orchestrator.workloads.lm:gpt", "params": {**SMALL, "dtype": dtype}, "batch_size": 4},
              "optimizer": {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01, "no_decay": []},
              "sync": {"policy": "bsp", "bucket_mb": 0.01}, "stop": {"max_steps": STEPS}, "eval_every": 0}
    job = LocalJob(config, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 8)
    ours = job.parameters("w0")
    assert all(torch.equal(a, b) for a, b in zip(ours, job.parameters("w1")))
    model = job.replicas["w0"].training.model
    assert model.head.weight is model.tok.weight  # still tied
    diff = max(float((p - q).abs().max()) for p, q in zip(ours, reference(8, dtype)))
    print(f"BSP on the byte-level GPT ({dtype}), 2 workers, vs single-process AdamW: {diff:.2e}")
    assert diff < bound
    records = [r for r in job.replicas["w0"].reporter.kept if "tokens" in r]
    assert records and all(r["tokens"] == 8 * 16 for r in records)


def test_evaluation_is_the_held_out_loss_and_its_perplexity():
    torch.manual_seed(0)
    workload = lm.gpt(**SMALL, eval_count=8)
    (rows,) = workload.eval_data.tensors
    assert rows.shape == (8, 17)
    out = workload.evaluate(workload.model, workload.eval_data)
    rows = rows.long()
    with torch.no_grad():
        expect = F.cross_entropy(workload.model(rows[:, :-1]).reshape(-1, 256), rows[:, 1:].reshape(-1)).item()
    assert abs(out["eval_loss"] - expect) < 1e-5
    assert abs(out["perplexity"] - math.exp(expect)) < 1e-3 and abs(out["bits_per_byte"] - expect / math.log(2)) < 1e-5
