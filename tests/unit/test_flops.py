"""FLOPs per token, peaks and MFU (orchestrator/workloads/flops.py): each count written out here from the
model's own dimensions (6N + 12·L·d·T, N every weight once less the position table), not from the helper."""
from __future__ import annotations

import pytest
import torch

from actors.observe import peaks
from orchestrator.workloads import flops
from orchestrator.workloads.lm import GPT, SIZES


def _block_params(d: int) -> int:
    """A pre-norm block's parameters: two LayerNorms (gain and bias), the qkv and output projections,
    and the 4x MLP, each Linear with its bias."""
    norms = 2 * (2 * d)
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
    return norms + attention + mlp


def test_tiny_gpt_count_by_hand():
    cfg = SIZES["tiny"]
    d, layers, vocab, context = cfg.d_model, cfg.n_layer, cfg.vocab, cfg.seq_len
    # token embedding (the output layer is the same weight), the blocks, the final LayerNorm; no position table
    n = vocab * d + layers * _block_params(d) + 2 * d
    assert n == 826_112
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == n + context * d  # the table left out is the only difference
    assert flops.flops_per_token(model, context) == 6 * n + 12 * layers * d * context
    assert flops.flops_per_token(model, 32) == 6 * n + 12 * layers * d * 32  # T is the context trained on


def test_hf_gpt2_config():
    transformers = pytest.importorskip("transformers")
    d, layers, vocab, positions, heads = 64, 3, 1000, 128, 4
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=d, n_head=heads, n_positions=positions, vocab_size=vocab))
    # wte (tied to lm_head), per block ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj, then ln_f; wpe left out
    n = vocab * d + layers * _block_params(d) + 2 * d
    assert flops.non_embedding_params(model) == n
    assert flops.flops_per_token(model, 100) == 6 * n + 12 * layers * d * 100


def test_unknown_model_has_no_count():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert flops.flops_per_token(model, 64) is None


def test_peak_on_cpu_only_from_the_environment(monkeypatch):
    monkeypatch.delenv(peaks.PEAK_ENV, raising=False)
    peak, source = peaks.peak_flops(torch.device("cpu"), torch.float32)
    assert peak is None and peaks.PEAK_ENV in source
    monkeypatch.setenv(peaks.PEAK_ENV, "2.5e12")
    assert peaks.peak_flops(torch.device("cpu"), torch.float32) == (2.5e12, peaks.PEAK_ENV)
    monkeypatch.setenv(peaks.PEAK_ENV, "fast")
    with pytest.raises(ValueError, match=peaks.PEAK_ENV):
        peaks.peak_flops(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("name", "dtype", "expected"), [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA H200", torch.float32, 67e12),
    ("NVIDIA L40S", torch.bfloat16, 362.05e12),  # not the L4's
    ("NVIDIA L4", torch.float16, 121e12),
    ("Tesla V100-SXM2-16GB", torch.bfloat16, None),
    ("NVIDIA GeForce GTX 1050", torch.bfloat16, None),
])
def test_gpu_table(monkeypatch, name, dtype, expected):
    monkeypatch.delenv(peaks.PEAK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, _source = peaks.peak_flops(torch.device("cuda", 0), dtype)
    assert peak == (None if expected is None else pytest.approx(expected))
    monkeypatch.setenv(peaks.PEAK_ENV, "1e15")  # the variable overrides the table
    assert peaks.peak_flops(torch.device("cuda", 0), dtype)[0] == 1e15


def test_mfu_and_measured_rate():
    assert flops.mfu(1000.0, 6e9, 1e13, 2) == pytest.approx(0.3)
    assert flops.measured_matmul_flops(torch.device("cpu"), torch.float32, size=64, seconds=0.01) > 0


def test_each_record_says_its_mfu_where_the_device_has_a_peak(tmp_path, monkeypatch):
    """A record's MFU: one worker's tokens (the global batch's over the members) over its compute (the step
    less its waits), times the model's FLOPs per token, over the device's peak; none without a peak (a CPU
    unless the environment gives one)."""
    from testkit.harness import LocalJob

    gpt = {"size": "tiny", "d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 16}
    config = {"name": "mfu", "seed": 0, "workers": {"count": 2, "cpus": 1},
              "workload": {"factory": "orchestrator.workloads.lm:gpt", "params": gpt, "batch_size": 4},
              "optimizer": {"name": "adamw", "lr": 3e-3}, "sync": {"policy": "bsp"}, "stop": {"max_steps": 4}, "eval_every": 0}
    monkeypatch.setenv(peaks.PEAK_ENV, "1e11")
    job = LocalJob(config, ["w0", "w1"], str(tmp_path / "peak"))
    job.run(("w0", "w1"), 8)
    model = job.replicas["w0"].training.model
    n = sum(p.numel() for p in model.parameters()) - model.pos.numel()
    per_token = 6 * n + 12 * 2 * 32 * 16
    for r in job.replicas["w0"].reporter.kept:
        assert r["mfu"] == pytest.approx((r["tokens"] / 2) * per_token / ((r["step_time"] - r["wait_s"]) * 1e11))
    monkeypatch.delenv(peaks.PEAK_ENV)
    job = LocalJob(config, ["w0", "w1"], str(tmp_path / "none"))
    job.run(("w0", "w1"), 8)
    assert all("mfu" not in r for r in job.replicas["w0"].reporter.kept)
