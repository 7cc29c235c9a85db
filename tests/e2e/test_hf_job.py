"""A Hugging Face causal LM through a real Ray job: BSP with a worker SIGKILLed at a named step (the
mechanism is Ray's: actors, a death, the re-formed group). The job finishes, the held-out loss goes
down, a checkpoint is written, and the final model loads with the output layer still tied to the
embedding. In the slow tier: the kill and the re-form through Ray are every model's (tests/e2e/test_elastic.py),
and a Hugging Face model's training, exactness and tied weights through a final model and a checkpoint's load
run in process (tests/unit/test_hf.py)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")

PARAMS = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "eval_count": 16}


@pytest.mark.slow  # the default tier's tests of its mechanism: docs/testing.md, "Moved to the slow tier"
def test_a_gpt2_trains_through_a_kill_and_keeps_its_tied_weights(run_root):
    from orchestrator.workloads.hf import causal_lm

    cfg = {"name": "hf-kill", "seed": 1, "workers": {"count": 3, "min": 2, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.hf:causal_lm", "params": PARAMS, "batch_size": 4},
           "optimizer": {"name": "adamw", "lr": 0.01}, "sync": {"policy": "bsp"},
           "checkpoint": {"every_steps": 20}, "stop": {"max_steps": 60}, "eval_every": 20,
           "faults": {"kills": [{"slot": "w1", "step": 25}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=240)
    assert result.state == "FINISHED", result
    deaths = [e for e in job.events() if e["kind"] == "reshape"
              and e["detail"].get("detector") in ("actor death", "collective failure")]
    assert deaths, "the kill at step 25 never showed as a membership change"
    evals = [r["metrics"]["eval_loss"] for r in job.history() if (r.get("metrics") or {}).get("eval_loss") is not None]
    torch.manual_seed(cfg["seed"])  # the initial model, as the job's factory made it
    initial = causal_lm(**PARAMS)
    before = initial.evaluate(initial.model, initial.eval_data)["eval_loss"]
    # from the initial model, not from step 20: by then the loss has fallen to a plateau that steps 20-60
    # cross up and down by a few hundredths, as the step the killed worker's replacement joins at decides
    assert len(evals) >= 2 and max(evals) < before - 1.0, (before, evals)
    model = job.model()
    assert model.lm_head.weight is model.transformer.wte.weight
    saved = sorted(Path(result.run_dir, "checkpoints").glob("step-*.pt"))
    assert saved, "no checkpoint written"
    state = torch.load(io.BytesIO(saved[-1].read_bytes()), weights_only=True)["model"]
    fresh = causal_lm(**PARAMS).model
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
