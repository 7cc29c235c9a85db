"""A device's dense peak FLOP/s, for the model FLOPs utilization (MFU) a replica records and the
language-model benchmark prints. Torch only to read a GPU's name; no Ray.

Peaks are the vendors' datasheet figures, dense (no 2:4 sparsity): tensor-core figures for bfloat16 and
float16, non-tensor figures for float32 (TF32 is not assumed). `ORCHESTRATOR_PEAK_FLOPS` (FLOP/s per
device, e.g. `989e12`) overrides any table entry, and is the only peak a CPU has.
"""
from __future__ import annotations

import os
import re

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
