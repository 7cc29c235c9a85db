"""What a job trains and on what: the workers section, the workload with its data loader, and the optimizer."""
from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from core.schema.errors import DAY_S, FieldError, within

MAX_WORKERS = 10_000
"""The most workers (and, separately, spares) a job may ask for: Ray's published scalability envelope
is about 10,000 actors in one cluster, and this control plane is measured up to 1,024 members
(docs/control-plane.md). A larger figure is a typo, refused at load, not a job that waits forever."""


@dataclass
class WorkersConfig:
    """How many worker actors, and what each one asks Ray for."""

    count: int = 2
    """Workers started at launch (and kept after failures when resources allow)."""
    min: int = 1
    """Below this many live workers the job pauses."""
    max: int | None = None
    """Upper bound for `scale`; defaults to `count`. At most `MAX_WORKERS` (10,000)."""
    cpus: float = 1.0
    """Logical CPUs per worker actor."""
    gpus: float = 0.0
    """GPUs per worker actor; > 0 selects NCCL."""
    scale_down: Literal["newest", "slowest"] = "newest"
    """Which workers leave on scale-down."""
    placement: Literal["pack", "spread"] = "pack"
    """Ray scheduling strategy for worker actors."""
    failure_budget: int = 3
    """Failures a slot may have before it is retired."""
    batch_mode: Literal["keep_global", "keep_worker"] = "keep_global"
    """On a reshape: keep the global batch (each worker's share adjusts), or keep the per-worker
    batch and scale the learning rate linearly with the world size."""
    on_failure: Literal["reshape", "fail"] = "reshape"
    """A dead or raising worker: re-form without it and start a replacement, or fail the job."""
    heartbeat_s: float = 10.0
    """A worker that does not answer the coordinator's heartbeat for this long (stopped, frozen) is evicted.
    In [0.1, 86400] s: the coordinator looks every `heartbeat_s / 4` (at most every second), and a
    heartbeat is a Ray call that takes milliseconds on a loaded node, so below 0.1 s the coordinator
    spins and evicts healthy workers; above a day no freeze is ever noticed (`errors.DAY_S`)."""
    hang_timeout_s: float = 300.0
    """A worker whose step has been computing for this long (a loop that never ends) is evicted. In
    [0.1, 86400] s: below 0.1 s every step is a hang; a step of more than a day is one."""
    start_grace_s: float = 30.0
    """At start, wait this long for all `count` workers before starting with at least `min`. In
    (0, 86400] s (a longer wait is a hang: `errors.DAY_S`)."""
    pause_after_s: float = 10.0
    """At start, the job is PAUSED once fewer than `min` workers could be placed for this long. In
    (0, 86400] s, as `start_grace_s`."""
    spares: int = 0
    """Hot spares: this many extra worker actors started (process, imports, the workload built)
    outside the group. A scale-up or a replacement takes a ready spare first and a new spare starts
    behind it once the membership has settled (no reshape pending), so that its start does not take
    the cores from the re-forming members. Each spare holds `cpus` and `gpus` like a worker, for the
    whole run. At most `MAX_WORKERS`."""

    huge_pages: bool = True
    """Back each worker's heap with transparent huge pages (glibc's `glibc.malloc.hugetlb=1`, set in the
    worker process's environment at its start; Linux with THP in `madvise` or `always` mode). A process
    killed by SIGKILL closes its sockets only after the kernel has freed its memory, page by page; with
    2-MiB pages that takes a fraction of the time, so the survivors and Ray see the death sooner
    (docs/benchmarks.md, "kill floor"). Off: the worker's allocator as the system sets it."""

    def __post_init__(self) -> None:
        if self.spares < 0:
            raise FieldError("spares", f"must not be negative, got {self.spares}")
        for knob in ("count", "max", "spares"):
            value = getattr(self, knob)
            if value is not None and value > MAX_WORKERS:
                raise FieldError(knob, f"at most {MAX_WORKERS} (Ray's envelope is about 10,000 actors a cluster; "
                                       f"this control plane is measured to 1,024 members), got {value}")
        if self.max is None:
            self.max = self.count
        if self.count < 1:
            raise FieldError("count", f"must be at least 1, got {self.count}")
        if self.min < 1:
            raise FieldError("min", f"must be at least 1, got {self.min}")
        if self.min > self.max:
            raise FieldError("min", f"min ({self.min}) must not exceed max ({self.max})")
        if not self.min <= self.count <= self.max:
            raise FieldError("count", f"must lie in [min, max] = [{self.min}, {self.max}], got {self.count}")
        if self.cpus < 0 or self.gpus < 0:
            raise FieldError("cpus" if self.cpus < 0 else "gpus", "must not be negative")
        if self.failure_budget < 1:
            raise FieldError("failure_budget", f"must be at least 1, got {self.failure_budget}")
        within(self, "heartbeat_s", 0.1, DAY_S, unit=" s")
        within(self, "hang_timeout_s", 0.1, DAY_S, unit=" s")
        within(self, "start_grace_s", 0.0, DAY_S, low_open=True, unit=" s")
        within(self, "pause_after_s", 0.0, DAY_S, low_open=True, unit=" s")


@dataclass
class LoaderConfig:
    """Background loading: threads that prepare the next steps' batches (index, collate, move to the
    device) while the current step computes. Off (0 workers): each batch is built on the step."""

    workers: int = 0
    """Threads that build batches ahead (a dataset whose `__getitem__` waits on a disk or a network
    overlaps the step; pure-Python decoding holds the GIL and overlaps little)."""
    prefetch: int = 2
    """Batches built ahead (each holds one step's share in memory)."""
    processes: bool = False
    """Read the samples in `workers` processes (each builds the workload once) instead of threads: for
    decoding that computes in Python and holds the GIL. Map-style and Hugging Face data only."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise FieldError("workers", f"must not be negative, got {self.workers}")
        if self.prefetch < 1:
            raise FieldError("prefetch", f"must be at least 1, got {self.prefetch}")


@dataclass
class WorkloadConfig:
    """The model, data and loss: `factory(**params)` returns a workload object."""

    factory: str = ""
    """`module:function`, importable from the job's working directory."""
    params: dict = field(default_factory=dict)
    """Keyword arguments for the factory."""
    batch_size: int = 32
    """Per-worker batch size at the starting world size."""
    micro_batch: int | None = None
    """Most samples one forward/backward takes. A larger share of the global batch (keep_global
    after the world shrinks) runs as micro-steps whose gradients accumulate locally; buckets are
    all-reduced on the last micro-step only. None: no limit."""
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    on_bad_sample: Literal["fail", "skip"] = "fail"
    """A training sample that raises when read, or whose shape or dtype differs from the rest of its batch:
    `fail` ends the job FAILED with the sample's id and the error in one line (no worker is retired or
    replaced); `skip` trains the mean over the samples read and records the id (a `samples_skipped` event)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.factory or ""):
            raise FieldError("factory", f"must look like 'package.module:function', got {self.factory!r}")
        if self.batch_size < 1:
            raise FieldError("batch_size", f"must be at least 1, got {self.batch_size}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise FieldError("micro_batch", f"must be at least 1, got {self.micro_batch}")


@dataclass
class LearningRate:
    """What every optimizer section has: the optimizer's name and the learning-rate schedule (linear
    warm-up, then constant or cosine)."""

    name: str = "sgd"
    lr: float = 0.1
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    """Floor of the cosine schedule."""
    clip_grad_norm: float | None = None
    """Clip the gradient to this L2 norm before each update (None: never): for the kinds that reduce every
    step, the reduced gradient (the same on every member, what `torch.nn.utils.clip_grad_norm_` does over
    the global batch); for the periodic, decentralized and background kinds each local step's gradient;
    for the server kinds the gradient the parameter server applies."""
    no_decay: list[str] | None = None
    """Parameters that take no weight decay, as `fnmatch` patterns of their names (`["*.bias"]`); `[]`: every
    parameter decays; unset: for the Adam family every bias, normalization layer and embedding is exempt
    (the usual transformer groups), for the others none (an L2 term on every weight, torch's default).
    Only matters with a positive weight decay."""
    lr_scaling: Literal["auto", "linear", "sqrt", "none"] = "auto"
    """How the learning rate follows the world size under `workers.batch_mode: keep_worker` (the global
    batch grows and shrinks with it): `linear` (the SGD rule), `sqrt` (the Adam rule), `none`; `auto` takes
    `sqrt` for the Adam family (adamw, Adam, NAdam, RAdam, Adamax) and `linear` for the others."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise FieldError("lr", f"must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise FieldError("warmup_steps", f"must not be negative, got {self.warmup_steps}")
        if self.clip_grad_norm is not None and not (0 < self.clip_grad_norm < math.inf):
            raise FieldError("clip_grad_norm", f"must be a positive finite norm, got {self.clip_grad_norm}")

    @property
    def adam_family(self) -> bool:
        """Whether the optimizer adapts per coordinate (Adam's second moment): its step size barely
        follows the gradient's scale, so a larger batch takes a square-root learning-rate rule."""
        return self.name.removeprefix("torch.optim.").lower() in ("adamw", "adam", "nadam", "radam", "adamax")

    @property
    def resize_rule(self) -> Literal["linear", "sqrt", "none"]:
        """`lr_scaling` with `auto` resolved for this optimizer."""
        if self.lr_scaling == "auto":
            return "sqrt" if self.adam_family else "linear"
        return self.lr_scaling


@dataclass
class OptimizerConfig(LearningRate):
    """This project's fast paths: `sgd` (its flat SGD, torch's rule) or `adamw` (torch's AdamW), with
    their knobs; the Adam-based policies (qadam, dadam) read `adamw`'s."""

    name: Literal["sgd", "adamw"] = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    implementation: Literal["auto", "fused", "foreach", "loop"] = "auto"
    """`adamw`'s kernel: `fused` (one kernel for all parameters; CUDA and CPU), `foreach` (a few kernels per
    group), `loop` (one parameter at a time); `auto`: fused on a GPU, loop on a CPU (torch's CPU default)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.momentum < 0 or self.weight_decay < 0:
            raise FieldError("momentum" if self.momentum < 0 else "weight_decay", "must not be negative")
        if self.nesterov and (self.name != "sgd" or self.momentum <= 0):
            raise FieldError("nesterov", "needs name: sgd and momentum > 0")


@dataclass
class TorchOptimizerConfig(LearningRate):
    """Any optimizer of `torch.optim` by its class name (`Adagrad`, `torch.optim.RMSprop`), with its
    keyword arguments written beside `name` (`{name: Adagrad, lr: 0.01, lr_decay: 0.001}`; the parser
    gathers them into `args`). The name and the arguments are checked against torch when the config is
    loaded (algorithms/policies/optim.py `check_optimizer`), where torch may be imported."""

    args: dict = field(default_factory=dict)
    """The optimizer's keyword arguments other than the parameters and `lr`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not re.fullmatch(r"(torch\.optim\.)?[A-Za-z_]\w*", self.name):
            raise FieldError("name", f"names sgd, adamw or a torch.optim class (Adagrad, torch.optim.RMSprop), "
                                     f"got {self.name!r}")
        for key, value in self.args.items():
            if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
                raise FieldError(key, f"must be a finite number, got {value}")


PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")


@dataclass
class TrainingConfig:
    """How each step computes."""

    precision: Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16"] = "fp32"
    """`fp32`; `bf16-mixed` and `fp16-mixed`: the forward and the loss under autocast, with float32 weights,
    gradients and optimizer state (fp16 with dynamic loss scaling: a step whose gradient overflows is
    skipped, the same on every member); `bf16`: the model itself in bfloat16 (weights, gradients and
    optimizer state: an Adam step smaller than bf16's resolution is lost, so a warning is printed)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward instead of keeping them from the forward (less memory, about
    a third more compute): the model's own `gradient_checkpointing_enable()` (Hugging Face models, the
    built-in GPT); a model without one is refused when the workers build it."""
    compile: bool = False
    """Compile the model's forward (and, through it, its backward) with `torch.compile`, in place
    (`nn.Module.compile`: its state and parameter names unchanged). A hot spare compiles while it waits,
    on one batch of the job's own data whose batch dimension is marked dynamic, so that an adopted spare's
    first step, whatever its share of the global batch, does not compile while the group waits."""
    compile_backend: str = "inductor"
    """`torch.compile`'s backend: `inductor` (generated kernels; needs a C++ compiler on a CPU), or
    another that torch lists (`aot_eager`: traced, not code-generated)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise FieldError("precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.compile_backend:
            raise FieldError("compile_backend", "must name a torch.compile backend (inductor, aot_eager, ...)")


BUILT_IN_OPTIMIZERS = typing.get_args(typing.get_type_hints(OptimizerConfig)["name"])
"""The names `optimizer:` takes for this project's own paths (`sgd`, `adamw`); any other is a torch class."""

Optimizer = OptimizerConfig | TorchOptimizerConfig
"""The type of `JobConfig.optimizer`: parsed by its `name` (core/schema/parser.py)."""
