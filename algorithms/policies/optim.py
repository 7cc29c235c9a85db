"""Optimizers and learning-rate schedules from the job's `optimizer:` section. Pure torch, no Ray.

`sgd` is this module's `SGD` and `adamw` torch's AdamW; any other name is a torch.optim class, whose
name, arguments and first step `check_optimizer` tries when the config is loaded, so that a mistake
exits 2 in one line instead of failing in every worker.

The schedule is a function of the committed step only, so a joiner or a resumed run that
knows the step knows the learning rate: linear warm-up over `warmup_steps`, then constant or
cosine decay to `min_lr` at `total_steps`. `lr_scale` multiplies the base LR (linear scaling
on reshape, when the config asks for it).
"""
from __future__ import annotations

import collections
import fnmatch
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

from core.schema import BUILT_IN_OPTIMIZERS, ConfigError, LearningRate, Optimizer, OptimizerConfig, TorchOptimizerConfig
from core.schema.errors import nearest


def build_optimizer(model: torch.nn.Module | Iterable[torch.Tensor], cfg: Optimizer):
    """`sgd`: this module's `SGD` (torch's rule on flat buffers); `adamw`: torch's AdamW; any other name:
    that torch.optim class with the config's arguments (checked at load: `check_optimizer`). Given a
    model, its trainable parameters in the weight-decay groups `parameter_groups` makes; given tensors
    (a parameter server's flat shards), one group."""
    groups: list[dict[str, Any]] = parameter_groups(model, cfg) if isinstance(model, torch.nn.Module) \
        else [{"params": list(model)}]
    if isinstance(cfg, TorchOptimizerConfig):
        return optimizer_class(cfg.name)(groups, lr=cfg.lr, **cfg.args)
    if cfg.name == "sgd":
        return SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    device = groups[0]["params"][0].device
    kernel = cfg.implementation if cfg.implementation != "auto" else ("fused" if device.type == "cuda" else "loop")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             foreach=kernel == "foreach", fused=True if kernel == "fused" else None)


NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.LocalResponseNorm, torch.nn.modules.batchnorm._NormBase,
         *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()))


def _exempt_by_default(model: torch.nn.Module) -> set[int]:
    """The parameters the usual transformer groups keep from weight decay: every bias and every other
    one-dimensional parameter (gains), every parameter of a normalization layer (torch's, or any module
    whose class name ends in `Norm`: Hugging Face's LlamaRMSNorm, T5LayerNorm), every embedding (and the
    output layer tied to it: the same parameter), and those the model names itself in
    `no_weight_decay()` (timm's convention: a position table held as a bare parameter)."""
    exempt = {id(p) for p in model.parameters() if p.dim() < 2}
    named = getattr(model, "no_weight_decay", None)
    if callable(named):
        exempt |= {id(p) for n, p in model.named_parameters() if n in set(named())}
    for module in model.modules():
        if isinstance(module, (*NORMS, torch.nn.Embedding)) or type(module).__name__.endswith("Norm"):
            exempt |= {id(p) for p in module.parameters(recurse=False)}
    return exempt


def parameter_groups(model: torch.nn.Module, cfg: Optimizer) -> list[dict[str, Any]]:
    """The model's trainable parameters (each once, in the model's order) as the optimizer's groups: one,
    or, where `optimizer.no_decay` exempts some from a positive weight decay, the decayed ones then the
    exempt ones with `weight_decay: 0`. `no_decay` unset exempts `_exempt_by_default`'s for the Adam
    family (AdamW's decoupled decay is the transformer's) and none for the others (SGD's decay is an
    L2 term on every weight, as torch's default); `[]` none; a list of `fnmatch` patterns the
    parameters whose names match one."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = cfg.weight_decay if isinstance(cfg, OptimizerConfig) else cfg.args.get("weight_decay", 0.0)
    patterns = cfg.no_decay
    if not decay or patterns == [] or (patterns is None and not cfg.adam_family):
        return [{"params": [p for _, p in named]}]
    exempt = _exempt_by_default(model) if patterns is None else \
        {id(p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)}
    groups: list[dict[str, Any]] = [{"params": [p for _, p in named if id(p) not in exempt]},
                                    {"params": [p for _, p in named if id(p) in exempt], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def weight_decay_of(optimizer: Any, params: Sequence[torch.Tensor]) -> list[float]:
    """Each of `params`'s weight decay in `optimizer`'s groups: what a policy that applies Adam's rule
    itself (qadam, dadam) decays each parameter by."""
    by_param = {id(p): float(g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    return [by_param[id(p)] for p in params]


def torch_optimizers() -> list[str]:
    """The optimizer classes torch.optim offers, by name."""
    return sorted(name for name, cls in vars(torch.optim).items()
                  if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer)


def optimizer_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The torch.optim class `name` (`Adagrad` or `torch.optim.Adagrad`); a `ConfigError` naming the nearest
    when there is none."""
    short = name.removeprefix("torch.optim.")
    if short not in torch_optimizers():
        near = nearest(short, [*torch_optimizers(), *BUILT_IN_OPTIMIZERS])
        hint = f"did you mean {near}? " if near else ""
        raise ConfigError(f"optimizer.name: {name!r} is not an optimizer of torch.optim; {hint}(choose "
                          f"{' or '.join(BUILT_IN_OPTIMIZERS)}, or one of: {', '.join(torch_optimizers())})")
    return getattr(torch.optim, short)


def check_optimizer(cfg: TorchOptimizerConfig) -> None:
    """At config load, a `ConfigError` for what would fail in every worker: a name torch.optim does not
    have, an argument its constructor does not take (the nearest named), an argument value it refuses, or
    an optimizer that cannot take the step a job takes (one `step()` on a dense gradient, no closure:
    LBFGS, SparseAdam). Tried on a two-element parameter."""
    cls, title = optimizer_class(cfg.name), cfg.name.removeprefix("torch.optim.")
    accepted = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        names = [n for n in accepted if n not in ("params", "lr")]
        for key in cfg.args:
            if key not in names:
                near = nearest(key, names)
                raise ConfigError(f"optimizer.{key}: {title} takes no argument {key!r}; "
                                  f"{f'did you mean {near}? ' if near else ''}(its arguments: {', '.join(names)})")
    param = torch.zeros(2, requires_grad=True)
    try:
        optimizer = cls([param], lr=cfg.lr, **cfg.args)
    except (TypeError, ValueError, RuntimeError) as err:
        shown = ", ".join(f"{k}={v!r}" for k, v in {"lr": cfg.lr, **cfg.args}.items())
        raise ConfigError(f"optimizer: {title}({shown}) fails on a two-element parameter: {err}") from None
    param.grad = torch.zeros_like(param)
    try:
        optimizer.step()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(f"optimizer.name: {title} cannot take a training step (one step() on a dense "
                          f"gradient, no closure): {err}") from None


def lr_at(step: int, cfg: LearningRate, total_steps: int | None, lr_scale: float = 1.0) -> float:
    """Learning rate used for the update that produces committed step `step + 1`."""
    base = cfg.lr * lr_scale
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine" and total_steps:
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return cfg.min_lr + (base - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return base


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def contiguous_runs(tensors: Sequence[torch.Tensor]) -> list[list[int]] | None:
    """The indices of `tensors` grouped into runs that lie back to back in one storage, each run in
    memory order; None when a tensor is not contiguous or the dtypes differ."""
    if not tensors or any(not t.is_contiguous() or t.dtype != tensors[0].dtype for t in tensors):
        return None
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs = [[order[0]]]
    for i in order[1:]:
        prev, t = tensors[runs[-1][-1]], tensors[i]
        if (t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                and t.data_ptr() == prev.data_ptr() + prev.numel() * prev.element_size()):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def flat_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-d tensor over `numel` elements of `first`'s storage, starting where `first` starts."""
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,), (1,))


class SGD:
    """Stochastic gradient descent (momentum, dampening, Nesterov, weight decay): torch.optim.SGD's
    rule and state, bit for bit (tested), on whole flat buffers.

    Why not torch's own: its update costs three operations per parameter tensor plus a profiling
    scope per step, and constructing any `torch.optim.Optimizer` imports `torch._dynamo`, about
    70 MiB of resident memory in every worker that never compiles anything. Here the gradients
    already lie back to back (views into the all-reduce's buckets), so the parameters and momentum
    buffers are laid out the same way, as views into flat tensors, and each run takes `mul_`/`add_`
    once; element by element the arithmetic is torch's, in the same order. Before every step the
    layout is checked against the tensors' addresses: anything that replaced a parameter, gradient
    or buffer (a loaded state, a new epoch's buckets, `vector_to_parameters`) makes it lay them out
    again. Where gradients are not laid out so (the first step, separate tensors) it steps per
    tensor, as torch does. `state_dict()` has torch's format, so either optimizer loads the other's."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if lr < 0.0 or momentum < 0.0 or weight_decay < 0.0:
            raise ValueError(f"SGD: lr, momentum and weight_decay must be >= 0 (got {lr}, {momentum}, {weight_decay})")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")
        given = list(params)
        if not given:
            raise ValueError("SGD: got an empty parameter list")
        groups = cast(list[dict[str, Any]], given) if isinstance(given[0], dict) else [{"params": given}]
        self.defaults: dict[str, Any] = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                         "nesterov": nesterov, "maximize": False, "foreach": False, "differentiable": False, "fused": None}
        self.param_groups: list[dict[str, Any]] = [{**self.defaults, **g, "params": list(g["params"])}
                                                   for g in groups]  # as torch's optimizers
        self.state: collections.defaultdict = collections.defaultdict(dict)
        self._key: list | None = None
        self._runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.nn.Parameter]]] = []

    def __repr__(self) -> str:
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return f"SGD({group})"

    # ------------------------------------------------------------------ torch's optimizer surface
    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> dict:
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(v) for p, v in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                       for a, b in zip(saved, self.param_groups)):
            raise ValueError("SGD.load_state_dict: the saved parameter groups do not match this optimizer's")
        by_index = {i: p for g_saved, g in zip(saved, self.param_groups) for i, p in zip(g_saved["params"], g["params"])}
        self.state = collections.defaultdict(dict)
        for i, values in state_dict["state"].items():
            p = by_index[int(i)]
            self.state[p] = {k: (v.to(dtype=p.dtype, device=p.device) if isinstance(v, torch.Tensor) and p.is_floating_point()
                                 else v) for k, v in values.items()}
        for g_saved, g in zip(saved, self.param_groups):
            g.update({k: v for k, v in g_saved.items() if k != "params"})
        self._key = None

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        params = group["params"]
        if len(self.param_groups) == 1 and (self._key is not None and self._current_key(params) == self._key
                                            or self._layout(params)):
            self._flat_step(group)
        else:
            for g in self.param_groups:
                self._tensor_step(g)

    def _tensor_step(self, group: dict) -> None:
        """torch's single-tensor rule, one parameter at a time."""
        momentum, dampening, decay, nesterov, lr = (group["momentum"], group["dampening"], group["weight_decay"],
                                                    group["nesterov"], group["lr"])
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad.add(p, alpha=decay) if decay != 0 else p.grad
            if momentum != 0:
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad = grad.add(buf, alpha=momentum) if nesterov else buf
            p.add_(grad, alpha=-lr)

    def _flat_step(self, group: dict) -> None:
        momentum, dampening, decay, nesterov, lr = (group["momentum"], group["dampening"], group["weight_decay"],
                                                    group["nesterov"], group["lr"])
        for k, (flat_p, flat_g, flat_b, members) in enumerate(self._runs):
            grad = flat_g.add(flat_p, alpha=decay) if decay != 0 else flat_g
            if momentum != 0:
                if flat_b is None:  # the first step: the buffer is the gradient, as in torch
                    flat_b = torch.clone(grad).detach()
                    offset = 0
                    for p in members:
                        self.state[p]["momentum_buffer"] = flat_b[offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
                    self._runs[k] = (flat_p, flat_g, flat_b, members)
                    self._key = None  # the buffers' addresses are new
                else:
                    flat_b.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad = grad.add(flat_b, alpha=momentum) if nesterov else flat_b
            flat_p.add_(grad, alpha=-lr)
        if self._key is None:
            self._key = self._current_key(group["params"])

    def _current_key(self, params: list[torch.nn.Parameter]) -> list:
        state = self.state
        key = []
        for p in params:
            g, buf = p.grad, state[p].get("momentum_buffer") if p in state else None
            key.append((p.data_ptr(), None if g is None else g.data_ptr(), None if buf is None else buf.data_ptr()))
        return key

    def _layout(self, params: list[torch.nn.Parameter]) -> bool:
        """Lay parameters and momentum buffers out in the gradients' runs; False when they cannot be
        (a missing or sparse gradient, mixed dtypes or devices, gradients that are not back to back)."""
        maybe = [p.grad for p in params]
        if any(g is None or g.is_sparse for g in maybe):
            return False
        grads = cast(list[torch.Tensor], maybe)  # none is None (checked above)
        if any(p.dtype != grads[0].dtype or p.device != grads[0].device for p in params):
            return False
        runs = contiguous_runs(grads)
        if runs is None or len(runs) == len(params) > 1:
            return False  # nothing lies back to back: per tensor is as cheap
        laid = []
        for run in runs:
            members = [params[i] for i in run]
            bufs = [self.state[p].get("momentum_buffer") if p in self.state else None for p in members]
            if any(b is None for b in bufs) and not all(b is None for b in bufs):
                return False
            flat_g = flat_view(grads[run[0]], sum(p.numel() for p in members))
            flat_p = _flatten(members, members)
            # all or none are None (checked above)
            flat_b = None if bufs[0] is None else _flatten(cast(list[torch.Tensor], bufs), [self.state[p] for p in members])
            laid.append((flat_p, flat_g, flat_b, members))
        self._runs = laid
        self._key = self._current_key(params)
        return True


def _flatten(tensors: Sequence[torch.Tensor], owners: Sequence) -> torch.Tensor:
    """One flat tensor over `tensors`, in order: their own storage when they already lie so, else a new
    one that each owner's tensor (a parameter's data, a state's momentum buffer) becomes a view of."""
    runs = contiguous_runs(tensors)
    numel = sum(t.numel() for t in tensors)
    if runs is not None and runs == [list(range(len(tensors)))]:
        return flat_view(tensors[0], numel)
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    for t, owner in zip(tensors, owners):
        view = flat[offset:offset + t.numel()].view_as(t)
        if isinstance(owner, dict):
            owner["momentum_buffer"] = view
        else:
            owner.data = view
        offset += t.numel()
    return flat
