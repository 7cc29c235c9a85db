"""Any Hugging Face causal LM as a workload (orchestrator/workloads/hf.py), in process: BSP on a
2-layer GPT-2 built from a `transformers` configuration equals single-process training; the
synchronous, periodic (DiLoCo) and server (ASP) kinds train it (held-out loss down) and their final
model and a checkpoint of it keep the tied weights and every state entry; without `transformers` the
factory fails at config time in one line naming the extra."""
from __future__ import annotations

import io
import subprocess
import sys

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
