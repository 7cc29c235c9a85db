"""A transformer's training FLOPs per token, a device's dense peak, and the model FLOPs utilization (MFU)
they give: pure arithmetic, with torch only to read a model's shapes and a GPU's name. No Ray.

FLOPs per token follow nanoGPT's `estimate_mfu` (after the PaLM paper's appendix B): 6N for the weights'
matrix multiplies (2 forward, 4 backward, per parameter and token) plus 12·L·d·T for attention's scores
and weighted sums (L layers, width d, context T). N is every parameter counted once (an output layer tied
to the token embedding once) less the learned position tables, which are looked up, not multiplied: the
count nanoGPT's `get_num_params()` makes. A model whose depth and width cannot be read (the built-in GPT's
`cfg`, or a Hugging Face `config`) has no count: None, never a guess.

Peaks are the vendors' datasheet figures, dense (no 2:4 sparsity): tensor-core figures for bfloat16 and
float16, non-tensor figures for float32 (TF32 is not assumed). `ORCHESTRATOR_PEAK_FLOPS` (FLOP/s per
device, e.g. `989e12`) overrides any table entry, and is the only peak a CPU has: a measured matmul rate
is what the device achieves, not its peak (`measured_matmul_flops` measures one, for a caller to label).
"""
from __future__ import annotations

import os
import re
import time

import torch

PEAK_ENV = "ORCHESTRATOR_PEAK_FLOPS"

TFLOPS = 1e12
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
PEAKS: list[tuple[str, str, dict[torch.dtype, float]]] = [
    # (pattern in torch.cuda.get_device_name, the datasheet's name, dense peak per dtype); the first match wins
    (r"H100.*NVL", "H100 NVL", {_BF16: 835 * TFLOPS, _FP16: 835 * TFLOPS, _FP32: 60 * TFLOPS}),
    (r"H100.*PCIe", "H100 PCIe", {_BF16: 756 * TFLOPS, _FP16: 756 * TFLOPS, _FP32: 51 * TFLOPS}),
    (r"H100", "H100 SXM", {_BF16: 989.4 * TFLOPS, _FP16: 989.4 * TFLOPS, _FP32: 67 * TFLOPS}),
    (r"H200.*NVL", "H200 NVL", {_BF16: 835 * TFLOPS, _FP16: 835 * TFLOPS, _FP32: 60 * TFLOPS}),
    (r"H200", "H200 SXM", {_BF16: 989.4 * TFLOPS, _FP16: 989.4 * TFLOPS, _FP32: 67 * TFLOPS}),
    (r"A100", "A100", {_BF16: 312 * TFLOPS, _FP16: 312 * TFLOPS, _FP32: 19.5 * TFLOPS}),
    (r"L40S", "L40S", {_BF16: 362.05 * TFLOPS, _FP16: 362.05 * TFLOPS, _FP32: 91.6 * TFLOPS}),
    (r"\bL4\b", "L4", {_BF16: 121 * TFLOPS, _FP16: 121 * TFLOPS, _FP32: 30.3 * TFLOPS}),
    (r"A10G", "A10G (A10's datasheet figures)", {_BF16: 125 * TFLOPS, _FP16: 125 * TFLOPS, _FP32: 31.2 * TFLOPS}),
    (r"V100.*PCIE", "V100 PCIe (no bfloat16 tensor cores)", {_FP16: 112 * TFLOPS, _FP32: 14 * TFLOPS}),
    (r"V100", "V100 SXM2 (no bfloat16 tensor cores)", {_FP16: 125 * TFLOPS, _FP32: 15.7 * TFLOPS}),
]


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a `DistributedDataParallel` (or any wrapper holding it as `.module`)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _depth_and_width(model: torch.nn.Module) -> tuple[int, int] | None:
    """(layers, width) of the built-in GPT (`cfg.n_layer`, `cfg.d_model`) or a Hugging Face model
    (`config.n_layer` or `num_hidden_layers`, `config.n_embd` or `hidden_size`); None for another model."""
    from orchestrator.workloads.lm import GPT

    if isinstance(model, GPT):
        return model.cfg.n_layer, model.cfg.d_model
    config = getattr(model, "config", None)
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None)
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None)
    if isinstance(layers, int) and isinstance(width, int) and layers > 0 and width > 0:
        return layers, width
    return None


def _position_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """The learned position tables: the built-in GPT's `pos`; a Hugging Face model's embeddings other than
    its token embedding (GPT-2's `wpe`). A rotary model has none."""
    from orchestrator.workloads.lm import GPT

    if isinstance(model, GPT):
        return [model.pos]
    lookup = getattr(model, "get_input_embeddings", None)
    tokens = lookup() if callable(lookup) else None
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding) and m is not tokens]


def non_embedding_params(model: torch.nn.Module) -> int:
    """N: every parameter once (`parameters()` lists a tied weight once) less the learned position tables."""
    model = _unwrapped(model)
    positions = {id(t) for t in _position_tables(model)}
    return sum(p.numel() for p in model.parameters() if id(p) not in positions)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token, 6N + 12·L·d·T (T = `seq_len`), as the module's text defines them; None
    for a model whose depth and width cannot be read."""
    model = _unwrapped(model)
    shape = _depth_and_width(model)
    if shape is None:
        return None
    layers, width = shape
    return 6.0 * non_embedding_params(model) + 12.0 * layers * width * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(the dense peak FLOP/s of one `device` computing in `dtype`, where the figure comes from):
    `ORCHESTRATOR_PEAK_FLOPS` when set; else the table for a known GPU; else (None, why not)."""
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(f"{PEAK_ENV}={override!r}: must be a number of FLOP/s per device, e.g. 989e12") from None
        if not value > 0:
            raise ValueError(f"{PEAK_ENV}={override!r}: must be a positive number of FLOP/s per device")
        return value, f"{PEAK_ENV}"
    if device.type != "cuda":
        return None, f"no peak for a {device.type} device (set {PEAK_ENV})"
    name = torch.cuda.get_device_name(device)
    for pattern, label, figures in PEAKS:
        if re.search(pattern, name):
            if dtype not in figures:
                return None, f"{label} datasheet: no {dtype} figure (set {PEAK_ENV})"
            return figures[dtype], f"{label} datasheet, dense {str(dtype).removeprefix('torch.')}"
    return None, f"unknown GPU {name!r} (set {PEAK_ENV})"


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    """The FLOP/s a square `size` matmul achieves on `device` in `dtype` (with this process's threads),
    timed for about `seconds` after a warm-up: what the device reaches, not its peak."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        torch.mm(a, b)
    sync()
    count, started = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        if count % 4 == 0:
            sync()
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                return 2.0 * size ** 3 * count / elapsed


def mfu(tokens_per_s: float, flops_per_token: float, peak: float, devices: int) -> float:
    """Model FLOPs utilization: the FLOP/s the tokens took over what `devices` devices of `peak` offer."""
    return tokens_per_s * flops_per_token / (peak * devices)
