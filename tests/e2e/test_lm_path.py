"""The language-model path a user takes, end to end through Ray and the CLI: text no one here wrote (a few
of the standard library's packages) tokenized by `prepare` with a byte-level BPE of 8,192 tokens trained
on it; a 2-layer GPT-2 of `transformers` trained on the shards through `bsp` with clipping (float32: this CPU has no bf16
instructions; the mixed modes' oracles are tests/unit/test_precision.py),
with a worker SIGKILLed at a named step and its replacement joining; the run exported by `export --hf`;
the folder loaded with `AutoModelForCausalLM.from_pretrained`, generating, and its held-out loss equal
to the run's last evaluation."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")

REPO = Path(__file__).resolve().parents[2]
TEXT = ("email", "json", "logging")
"""Standard-library packages: about 0.9 MB of Python no one here wrote."""


def cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{args[0]}: exit {done.returncode}: {done.stderr[-2000:]}"
    return done


def test_prepare_train_through_a_kill_and_a_join_export_and_load_with_transformers(run_root, tmp_path):
    from orchestrator.data.manifest import read_manifest
    from orchestrator.workloads.hf import causal_lm

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path / "stdlib-bpe"
    cli("prepare", *(str(stdlib / name) for name in TEXT), "--glob", "**/*.py", "--train-bpe", "8192",
        "--eval-fraction", "0.1", "--out", str(data))
    manifest = read_manifest(data)
    assert manifest.vocab_size == 8192 and manifest.dtype == "uint16" and manifest.eval is not None

    params = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "seq_len": 64,
              "data_dir": str(data), "eval_count": 24, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    cfg = {"name": "lm-path", "seed": 0, "workers": {"count": 2, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.hf:causal_lm", "params": params, "batch_size": 8},
           "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01, "clip_grad_norm": 1.0},
           "sync": {"policy": "bsp"}, "stop": {"max_steps": 24},
           "eval_every": 12, "faults": {"kills": [{"slot": "w1", "step": 6, "at": "step"}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=300)
    assert result.state == "FINISHED", result
    reshapes = [e["detail"] for e in job.events() if e["kind"] == "reshape"]
    assert any(d.get("detector") in ("actor death", "collective failure") for d in reshapes), reshapes  # the kill
    assert any(d.get("new_members") for d in reshapes), reshapes  # the replacement's join
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, 25))
    assert all(r["grad_norm"] > 0 for r in history)  # clipping measured every step
    last = history[-1]["metrics"]["eval_loss"]

    out = tmp_path / "hf"
    cli("export", str(result.run_dir), "--hf", str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == 8192 and len(tokenizer) == 8192
    assert model.lm_head.weight is model.transformer.wte.weight

    torch.manual_seed(0)
    held = causal_lm(**params)  # the run's held-out windows, as its factory reads them
    exported = held.evaluate(model, held.eval_data)["eval_loss"]
    print(f"prepared {manifest.train_tokens} training tokens; eval loss: run {last:.6f}, exported {exported:.6f}; "
          f"reshapes {json.dumps(reshapes)[:300]}")
    assert abs(exported - last) <= 1e-4

    prompt = tokenizer("import json\ndef ", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(generated[0]), str)
