"""A job's workload outside the step loop: built from its factory (seeded: identical replicas
everywhere), warmed up for a hot spare, timed for the planner; the device a worker trains on, and
how a batch (tensors in tuples, lists or dicts) moves to it.
"""
from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Callable
from typing import Any

import torch

from actors.plan import WorkerSpec
from actors.training import compiled, user_code
from actors.training.sources import indexable, is_ray_dataset, source_for
from algorithms.policies.base import get_algorithm
from algorithms.policies.optim import build_optimizer
from algorithms.policies.precision import MODEL_DTYPE
from algorithms.rules.sampler import GlobalSampler
from core.factory import check_factory
from core.schema import JobConfig, WorkloadRefused
from core.workload_api import WorkloadLike


def build_workload(cfg: JobConfig) -> WorkloadLike:
    """The job's workload from its factory, after seeding: identical initial replicas everywhere
    (verified by checksum at the first plan). What the factory raises leaves as a `WorkloadBug`."""
    torch.manual_seed(cfg.seed)
    workload = user_code.call("factory", check_factory(cfg.workload.factory), **cfg.workload.params)
    cast_to = MODEL_DTYPE.get(cfg.training.precision)  # pure bf16: the model itself (the mixed modes keep float32)
    if cast_to is not None:
        workload.model.to(cast_to)
    if cfg.training.activation_checkpointing:
        enable = getattr(workload.model, "gradient_checkpointing_enable", None)
        if not callable(enable):
            raise WorkloadRefused(f"training.activation_checkpointing: the workload's model ({type(workload.model).__name__}) "
                                  f"has no gradient_checkpointing_enable(); give it one (wrap its blocks in "
                                  f"torch.utils.checkpoint.checkpoint) or set it to false")
        takes = inspect.signature(enable).parameters
        # a Hugging Face model takes torch's non-reentrant checkpoint (the one its docs recommend; the
        # reentrant one drops the gradient of a block whose inputs need none)
        enable(**({"gradient_checkpointing_kwargs": {"use_reentrant": False}} if "gradient_checkpointing_kwargs" in takes else {}))
    if cfg.training.compile:
        compiled.compile_model(workload.model, cfg.training.compile_backend)
    return workload


def split_loss(returned: Any) -> tuple[Any, dict[str, Any]]:
    """What a workload's `loss(model, batch)` returned, as (the loss, its step metrics by name).

    It returns the loss, or the loss with step metrics: `(loss, {"accuracy": acc})`, or
    `{"loss": loss, "accuracy": acc}`. A metric is a number or a one-element tensor, kept as given
    (detached; a tensor is read only when its step is recorded, so no step waits on the device). The
    loss itself comes back as returned (whoever uses it checks it). TypeError, in one line naming the
    metric, for a value that is not a number or a return of another shape."""
    if isinstance(returned, dict):
        if "loss" not in returned:
            raise TypeError(f"workload.loss returned a dict without a 'loss' key (keys: {', '.join(map(repr, returned))}); "
                            f"return the loss, (loss, {{name: value}}) or {{'loss': loss, name: value}}")
        loss, metrics = returned["loss"], {k: v for k, v in returned.items() if k != "loss"}
    elif isinstance(returned, tuple):
        if len(returned) != 2 or not isinstance(returned[1], dict):
            raise TypeError(f"workload.loss returned a tuple of {len(returned)} "
                            f"({', '.join(type(r).__name__ for r in returned)}); return the loss, or "
                            f"(loss, {{name: value}}) with step metrics")
        loss, metrics = returned
        if "loss" in metrics:
            raise TypeError("workload.loss returned (loss, metrics) with a metric named 'loss'; name it otherwise")
    else:
        return returned, {}
    return loss, {_metric_name(name): _metric_value(name, value) for name, value in metrics.items()}


def _metric_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"workload.loss returned a step metric named {name!r}: a metric's name is a non-empty string")
    return name


def _metric_value(name: str, value: Any) -> Any:
    """A step metric's value, detached: a real number or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"workload.loss returned step metric {name!r} as a {value.dtype} tensor of shape "
                            f"{tuple(value.shape)}: a metric is one number (reduce it, e.g. with .mean())")
        return value.detach().reshape(())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"workload.loss returned step metric {name!r} as a {type(value).__name__} ({value!r:.40}): "
                    f"a metric is a number or a one-element tensor")


def time_steps(cfg: JobConfig, device: torch.device, steps: int = 12, warmup: int = 3, layout: bool = False) -> dict:
    """The job's workload timed as a worker runs it: one worker's batch (the next of the data's global
    order each time, read outside the timing) through forward, backward and the optimizer's step, on
    `device`, `steps` times after `warmup`. What `plan` and `auto` take one step's compute from, on a
    placed probe (actors/training/probe.py) or in the driver (orchestrator/planner.py `measure_compute`).
    Returns {"times": seconds of each step, "backward": seconds of each backward pass, "model_bytes"}, and
    with `layout` each trainable parameter's (element count, dtype name), in the model's order."""
    workload = build_workload(cfg)
    model = workload.model.to(device)
    optimizer = build_optimizer(model, cfg.optimizer)
    source = source_for(workload.train_data, cfg.seed, collate=getattr(workload, "collate_fn", None))
    size = cfg.workload.batch_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, backward = [], []
    for i in range(steps + warmup):
        batch = to_device(source.fetch(source.global_batch(i * size, size), i * size).batch, device)
        sync()
        began = time.perf_counter()
        optimizer.zero_grad()
        loss, _ = split_loss(workload.loss(model, batch))
        sync()
        forward_end = time.perf_counter()
        loss.backward()
        sync()
        backward_end = time.perf_counter()
        optimizer.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - began)
            backward.append(backward_end - forward_end)
    out = {"times": times, "backward": backward,
           "model_bytes": float(sum(p.numel() * p.element_size() for p in model.parameters()))}
    if layout:
        out["layout"] = layout_of(model)
    return out


def layout_of(model: torch.nn.Module) -> list[tuple[int, str]]:
    """Each trainable parameter of `model` (element count, torch dtype name), in the model's order: what
    its gradient buckets are made of."""
    return [(p.numel(), str(p.dtype).removeprefix("torch.")) for p in model.parameters() if p.requires_grad]


def warm_up(cfg: JobConfig, workload: Any, device: torch.device) -> None:
    """What a replica's first construction would import (the optimizer's first construction imports
    torch._dynamo: 1.4 s here; the policy's modules), and what its first step would pay on first use
    (the sampler's first permutation imports numpy.random: 10-13 ms here, on the joiner's
    first step, which the members wait for): a hot spare pays it before it is needed. On a GPU, the
    spare's CUDA context, its model on the device (the optimizer is then built over the device's
    parameters, as the replica's is) and cuBLAS's set-up too. With
    `training.compile`, the model's training graph is compiled too, on `device`, with one batch of the
    job's map-style data (a stream or a Ray Data dataset is not read ahead: its spare compiles on its
    first step)."""
    if device.type == "cuda":  # a spare on a GPU: its CUDA context, the model on the device, cuBLAS set up
        workload.model.to(device)
        torch.cuda.current_blas_handle()
        torch.ones(8, 8, device=device).matmul(torch.ones(8, 8, device=device))
        torch.cuda.synchronize(device)
    build_optimizer(workload.model, cfg.optimizer)
    get_algorithm(cfg.sync.policy)(cfg.sync, cfg.compression)
    GlobalSampler(1, cfg.seed).draw(0)
    if cfg.training.compile and not is_ray_dataset(workload.train_data) and indexable(workload.train_data):
        source = source_for(workload.train_data, cfg.seed, collate=getattr(workload, "collate_fn", None))
        size = min(cfg.workload.micro_batch or cfg.workload.batch_size, len(workload.train_data))
        batch = map_tensors(to_device(source.fetch(source.global_batch(0, size), 0).batch, device), compiled.dynamic_batch)
        compiled.warm(workload.model, batch, workload.loss, split_loss)


def ray_blocks(spec: WorkerSpec, dataset: Any) -> list[tuple[Any, int]]:
    """A Ray Data dataset's blocks, through the run's holder (imported only for a Ray Data job)."""
    from actors.training.data_holder import block_reader

    return block_reader(spec.job, spec.run_id, spec.namespace)(dataset)


def device_for(gpus: float, index: int = 0) -> torch.device:
    """The worker's device: its GPU when it asked for one (Ray makes the assigned GPU the only
    visible one, so it is cuda:0; replicas in threads of one process are given their own `index`),
    else the CPU."""
    if gpus > 0 and torch.cuda.is_available():
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`batch` (tensors in tuples, lists or dicts) with `fn` applied to each tensor; other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch on `device`."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def pinned(batch: Any) -> Any:
    """A batch's CPU tensors in page-locked memory (a copy from there to the GPU is asynchronous)."""
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


