"""Any Hugging Face causal LM as a workload (orchestrator/workloads/hf.py), in process: BSP on a
2-layer GPT-2 built from a `transformers` configuration equals single-process training; the
synchronous, periodic (DiLoCo) and server (ASP) kinds train it (held-out loss down) and their final
model and a checkpoint of it keep the tied weights and every state entry; without `transformers` the
factory fails at config time in one line naming the extra."""
from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.runs import checkpoints
from testkit.harness import LocalJob
from tests.unit.test_final_model_buffers import final_model
from tests.unit.test_policy_oracles import global_batch_ids

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")
from orchestrator.workloads.hf import causal_lm

SEED, STEPS = 3, 20
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
FACTORY = "orchestrator.workloads.hf:causal_lm"
REPO = Path(__file__).resolve().parents[2]


def config(sync: dict, params: dict, optimizer: dict, steps: int = STEPS) -> dict:
    return {"name": "hf", "seed": SEED, "workers": {"count": 2, "cpus": 0.5},
            "workload": {"factory": FACTORY, "params": params, "batch_size": 4},
            "optimizer": optimizer, "sync": sync, "stop": {"max_steps": steps}, "eval_every": 0}


def reference(global_batch: int, params: dict, lr: float) -> list[torch.Tensor]:
    """Single-process SGD with momentum on the next-token cross-entropy of each global batch, the
    logits taken from the model and the shift written out here."""
    torch.manual_seed(SEED)
    workload = causal_lm(**params)
    model = workload.model
    (rows,) = workload.train_data.tensors
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(STEPS):
        batch = rows[torch.tensor(global_batch_ids(step, global_batch, len(rows)))].long()
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_bsp_on_a_gpt2_from_its_config_equals_single_process_training(tmp_path):
    """In float32 (transformers takes a causal LM's loss in float32 whatever the model's dtype, so
    float64 would not be exact either)."""
    dtype, bound = "float32", 1e-5
    params = {**GPT2, "dtype": dtype}
    job = LocalJob(config({"policy": "bsp", "bucket_mb": 0.01}, params, {"name": "sgd", "lr": 0.5, "momentum": 0.9}),
                   ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 8)
    ours = job.parameters("w0")
    diff = max(float((p - q).abs().max()) for p, q in zip(ours, reference(8, params, 0.5)))
    print(f"BSP on a 2-layer GPT-2 ({dtype}), 2 workers, vs single-process SGD: {diff:.2e}")
    assert diff < bound


KINDS = {"bsp": {"policy": "bsp"}, "diloco": {"policy": "diloco", "h": 5, "outer_lr": 0.7, "outer_momentum": 0.9},
         "asp": {"policy": "asp"}}


@pytest.mark.parametrize("policy", list(KINDS))
def test_every_policy_kind_trains_a_hf_model_and_keeps_its_tied_weights(tmp_path, policy):
    params = dict(GPT2)
    adamw = {"name": "adamw", "lr": 0.01}
    job = LocalJob(config(KINDS[policy], params, adamw, steps=40), ["w0", "w1"], str(tmp_path))
    torch.manual_seed(SEED)
    fresh = causal_lm(**params)
    before = fresh.evaluate(fresh.model, fresh.eval_data)["eval_loss"]
    job.run(("w0", "w1"), 8)
    blob = final_model(job, policy, ["w0", "w1"])
    location = checkpoints.save(str(tmp_path / "store"), 40, blob, keep=1)  # a checkpoint of it, read back verified
    stored = checkpoints.read_verified(checkpoints.place(str(tmp_path / "store"))[0], location)
    for data in (blob, stored):
        state = torch.load(io.BytesIO(data), weights_only=True)["model"]
        model = causal_lm(**params).model
        model.load_state_dict(state)
        assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives the load
        assert torch.equal(model.lm_head.weight, state["transformer.wte.weight"])
        assert set(state) == set(model.state_dict())  # every entry, buffers included
        after = fresh.evaluate(model, fresh.eval_data)["eval_loss"]
        print(f"{policy}: held-out loss {before:.3f} -> {after:.3f}")
        assert after < before - 0.3


def test_without_transformers_the_factory_fails_at_config_time_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from core.factory import check_factory\n"
            f"check_factory({FACTORY!r})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and "pip install -e '.[hf]'" in last and "workload.factory" in last, out.stderr


PADDED = {**GPT2, "data": "tests.workloads.padded_text:make", "eval_count": 16}


def padded_reference(global_batch: int, lr: float, steps: int) -> list[torch.Tensor]:
    """One process: each global batch's mean cross-entropy over its loss tokens (labels shifted once,
    -100 ignored), written from the definition: the sum over every loss token of the batch divided by
    their count."""
    torch.manual_seed(SEED)
    workload = causal_lm(**PADDED)
    model, data = workload.model, workload.train_data
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        items = [data[i] for i in global_batch_ids(step, global_batch, len(data))]
        ids = torch.stack([item["input_ids"] for item in items])
        mask = torch.stack([item["attention_mask"] for item in items])
        labels = torch.stack([item["labels"] for item in items])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.clamp(min=0).reshape(-1), reduction="none")
        loss = (losses * keep.reshape(-1)).sum() / keep.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 3])
def test_a_padded_batch_trains_on_the_mean_over_the_global_batchs_loss_tokens(tmp_path, world, monkeypatch):
    """Members' shares hold different numbers of loss tokens (3 to 15 per row); BSP's step is the mean
    over all of them, as one process's, for any world size."""
    slots = [f"w{i}" for i in range(world)]
    cfg = config({"policy": "bsp", "bucket_mb": 0.01}, PADDED, {"name": "sgd", "lr": 0.5, "momentum": 0.9}, steps=8)
    cfg["workers"]["count"], cfg["workload"]["batch_size"] = world, 12 // world
    job = LocalJob(cfg, slots, str(tmp_path))
    job.run(tuple(slots), 12)
    diff = max(float((p - q).abs().max()) for p, q in zip(job.parameters("w0"), padded_reference(12, 0.5, 8)))
    print(f"padded GPT-2 at {world} workers vs one process's mean over loss tokens: {diff:.2e}")
    assert diff < 1e-5


def test_weighing_samples_instead_of_tokens_is_far_from_the_token_mean(tmp_path, monkeypatch):
    """The oracle above can fail: with each member's loss weighed by its samples (the mechanism off), the
    run moves away from the mean over loss tokens."""
    import orchestrator.workloads.hf as hf

    real = hf.causal_lm
    monkeypatch.setattr(hf, "causal_lm", lambda **kw: dataclasses.replace(real(**kw), loss_tokens=None))
    cfg = config({"policy": "bsp", "bucket_mb": 0.01}, PADDED, {"name": "sgd", "lr": 0.5, "momentum": 0.9}, steps=8)
    cfg["workload"]["batch_size"] = 6
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path))
    job.run(("w0", "w1"), 12)
    diff = max(float((p - q).abs().max()) for p, q in zip(job.parameters("w0"), padded_reference(12, 0.5, 8)))
    assert diff > 1e-4


def test_the_vocabulary_and_the_context_come_from_the_model_and_the_data():
    """A vocabulary larger than bytes (a real tokenizer's) trains, and the model is fed `seq_len` tokens,
    so a model with exactly `seq_len` positions fits (review bugs 1 and 2)."""
    workload = causal_lm(**{**GPT2, "n_positions": 16, "vocab_size": 50257})
    assert workload.model.config.vocab_size == 50257 and workload.tokens_per_sample == 16
    rows = torch.randint(0, 50257, (2, 17))
    loss = workload.loss(workload.model, (rows,))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="longer than the model's 16 positions"):
        causal_lm(**{**GPT2, "n_positions": 16, "seq_len": 32})


def test_the_gpt2_small_config_builds_gpt2_small():
    """configs/gpt2_small.yaml is GPT-2 small: 124,439,808 parameters with the output layer tied to the
    token embedding (GPT-2's published count), built from the config's own fields."""
    import transformers
    import yaml

    from orchestrator.config import load_config

    path = REPO / "configs" / "gpt2_small.yaml"
    config = load_config(path)
    params = dict(yaml.safe_load(path.read_text())["workload"]["params"])
    assert config.training.precision == "bf16-mixed" and config.optimizer.clip_grad_norm == 1.0
    fields = {k: v for k, v in params.items() if k not in ("model_type", "seq_len", "data_dir", "eval_count")}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(params["model_type"], vocab_size=50257, **fields))
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
