"""`training.compile`: the model's forward compiled with `torch.compile`, in place, and compiled ahead on a
hot spare so that its adoption does not stall the group.

Dynamo compiles a frame on its first call and again whenever a guard fails; the guards include the
input's shapes. A member's share of the global batch changes with the world size, so a spare warmed on
one batch size would compile again on its first step. `warm` therefore marks the warm-up batch's first
dimension dynamic: the graph it compiles serves any batch of two samples or more.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from core.schema import ConfigError


def check_backend(name: str) -> None:
    """One line (ConfigError) when `name` is not a backend this torch offers."""
    import torch._dynamo

    offered = torch._dynamo.list_backends(exclude_tags=())
    if name not in offered:
        raise ConfigError(f"training.compile_backend: {name!r} is not a torch.compile backend here; "
                          f"offered: {', '.join(sorted(offered))}")


def compile_model(model: torch.nn.Module, backend: str) -> None:
    """Compile `model`'s calls in place, as `nn.Module.compile` does (its parameters, buffers and
    state-dict names stay the module's own, so checkpoints, joiners and exports see an uncompiled model's
    state), but through `_call`: Dynamo skips frames in torch's own files, so `nn.Module.compile` of a
    model whose top module is torch's (an `nn.Sequential`) compiled nothing. Held as a partial of the
    model, a copy of the model (`copy.deepcopy`) calls itself, not the original."""
    compiled = _COMPILED.get(backend)
    if compiled is None:
        compiled = _COMPILED[backend] = torch.compile(_call, backend=backend)
    model._compiled_call_impl = functools.partial(compiled, model)


def _call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's call, from a frame Dynamo traces (this file is not torch's)."""
    return module._call_impl(*args, **kwargs)


_COMPILED: dict[str, Callable[..., Any]] = {}
"""One compiled `_call` per backend in this process: every model compiled with it shares its cache (a hot
spare's warm-up compiles the graph its replica then calls)."""


def dynamic_batch(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, its first (batch) dimension marked dynamic for Dynamo where it has one of two or more."""
    import torch._dynamo

    if tensor.dim() and tensor.shape[0] > 1:
        torch._dynamo.mark_dynamic(tensor, 0)
    return tensor


def warm(model: torch.nn.Module, batch: Any, loss: Callable[[torch.nn.Module, Any], Any],
         split: Callable[[Any], tuple[torch.Tensor, dict]]) -> None:
    """Compile `model`'s training graph ahead, on `batch` (its tensors passed through `dynamic_batch`):
    one forward and backward, after which the model is as before: its parameters are untouched (no
    optimizer step), its gradients and buffers (a batch norm's running statistics) restored, and the
    random generators' states too."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {p: p.grad for p in model.parameters()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        for p in model.parameters():
            p.grad = None
        returned, _ = split(loss(model, batch))
        returned.float().backward()
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

