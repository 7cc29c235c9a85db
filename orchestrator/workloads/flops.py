"""A transformer's training FLOPs per token and the model FLOPs utilization (MFU) it gives against a peak:
pure arithmetic, with torch only to read a model's shapes. No Ray.

FLOPs per token follow nanoGPT's `estimate_mfu` (after the PaLM paper's appendix B): 6N for the weights'
matrix multiplies (2 forward, 4 backward, per parameter and token) plus 12·L·d·T for attention's scores
and weighted sums (L layers, width d, context T). N is every parameter counted once (an output layer tied
to the token embedding once) less the learned position tables, which are looked up, not multiplied: the
count nanoGPT's `get_num_params()` makes. A model whose depth and width cannot be read (the built-in GPT's
`cfg`, or a Hugging Face `config`) has no count: None, never a guess.

A device's peak is actors/observe/peaks.py's (the replicas use it too); a CPU has none unless the
environment gives one, and a measured matmul rate is what a device achieves, not its peak
(`measured_matmul_flops` measures one, for a caller to label).
"""
from __future__ import annotations

import time

import torch


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a `DistributedDataParallel` (or any wrapper holding it as `.module`)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _depth_and_width(model: torch.nn.Module) -> tuple[int, int] | None:
    """(layers, width) of the built-in GPT (`cfg.n_layer`, `cfg.d_model`) or a Hugging Face model
    (`config.n_layer` or `num_hidden_layers`, `config.n_embd` or `hidden_size`); None for another model."""
    own = getattr(model, "cfg", None)  # the built-in GPT's GPTConfig
    if own is not None and hasattr(own, "n_layer") and hasattr(own, "d_model"):
        layers, width = own.n_layer, own.d_model
    else:
        config = getattr(model, "config", None)
        layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None)
        width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None)
    if isinstance(layers, int) and isinstance(width, int) and layers > 0 and width > 0:
        return layers, width
    return None


def _position_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """The learned position tables: those a model names itself (`position_tables()`: the built-in GPT's
    `pos`); else a Hugging Face model's embeddings other than its token embedding (GPT-2's `wpe`). A rotary
    model has none."""
    named = getattr(model, "position_tables", None)
    if callable(named):
        return list(named())
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
