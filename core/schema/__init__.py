"""The one schema module: every config dataclass, plus the status, result and event types.

Everything a user writes in YAML is parsed into the dataclasses here and validated before
anything starts (no Ray, no process group). Everything the job reports back (`JobStatus`,
`JobResult`, `Event`) is defined here too, so the driver, the actors and the CLI share one
vocabulary. Errors are `ConfigError`s whose single line names the key, the bad value and
what is allowed.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union


class OrchestratorError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(OrchestratorError):
    """Bad user input: a config key, a CLI argument or a YAML file. One line, names the key."""


class WorkloadRefused(OrchestratorError, ValueError):
    """The workload cannot be trained as configured (its data cannot be positioned, a policy cannot deal
    from it): the same in every worker, so a worker that raises it is not started again."""


class FieldError(ValueError):
    """Raised by a dataclass check; the parser prefixes the key path and turns it into ConfigError."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name
        self.message = message


# --------------------------------------------------------------------------- config
@dataclass
class WorkersConfig:
    """How many worker actors, and what each one asks Ray for."""

    count: int = 2
    """Workers started at launch (and kept after failures when resources allow)."""
    min: int = 1
    """Below this many live workers the job pauses."""
    max: int | None = None
    """Upper bound for `scale`; defaults to `count`."""
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
    """A worker that does not answer the coordinator's heartbeat for this long (stopped, frozen) is evicted."""
    hang_timeout_s: float = 300.0
    """A worker whose step has been computing for this long (a loop that never ends) is evicted."""
    start_grace_s: float = 30.0
    """At start, wait this long for all `count` workers before starting with at least `min`."""
    pause_after_s: float = 10.0
    """At start, the job is PAUSED once fewer than `min` workers could be placed for this long."""
    spares: int = 0
    """Hot spares: this many extra worker actors started (process, imports, the workload built)
    outside the group. A scale-up or a replacement takes a ready spare first and a new spare starts
    behind it once the membership has settled (no reshape pending), so that its start does not take
    the cores from the re-forming members. Each spare holds `cpus` and `gpus` like a worker, for the
    whole run."""

    def __post_init__(self) -> None:
        if self.spares < 0:
            raise FieldError("spares", f"must not be negative, got {self.spares}")
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
        for knob in ("heartbeat_s", "hang_timeout_s", "start_grace_s", "pause_after_s"):
            if getattr(self, knob) <= 0:
                raise FieldError(knob, f"must be positive, got {getattr(self, knob)}")


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
    """A training sample that raises when read: `fail` fails the job with the sample's id and the error;
    `skip` trains the rest of its batch and records the id (a `samples_skipped` event)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.factory or ""):
            raise FieldError("factory", f"must look like 'package.module:function', got {self.factory!r}")
        if self.batch_size < 1:
            raise FieldError("batch_size", f"must be at least 1, got {self.batch_size}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise FieldError("micro_batch", f"must be at least 1, got {self.micro_batch}")


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule (linear warm-up, then constant or cosine)."""

    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    """Floor of the cosine schedule."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise FieldError("lr", f"must be positive, got {self.lr}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise FieldError("momentum" if self.momentum < 0 else "weight_decay", "must not be negative")
        if self.nesterov and (self.name != "sgd" or self.momentum <= 0):
            raise FieldError("nesterov", "needs name: sgd and momentum > 0")
        if self.warmup_steps < 0:
            raise FieldError("warmup_steps", f"must not be negative, got {self.warmup_steps}")


@dataclass
class BSPConfig:
    """`bsp`: synchronous gradient all-reduce every step, bucketed and overlapped with backward."""

    policy: Literal["bsp"] = "bsp"
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB."""
    engine: Literal["auto", "reducer", "python"] = "auto"
    """Who buckets and launches the gradients: `reducer` is torch's C++ reducer (DDP's core) on each
    membership epoch's group (gloo with CPU parameters, NCCL with GPU ones), with the vote as one more
    leaf; `python` is this project's own bucket hooks (the only path for codecs and for GPUs shared
    over gloo); `auto` takes the reducer where it can run and the Python buckets elsewhere."""
    hierarchical: bool = False
    """BAGUA's hierarchical all-reduce: reduce within each node to a leader in full precision, all-reduce
    among the leaders over the links between nodes (compressed through `compression.codec`'s
    scatter-gather where there is one: `bytegrad`, or `bsp` with a codec), send the sum back within the
    node (on the Python buckets)."""

    def __post_init__(self) -> None:
        _positive(self, "bucket_mb")
        if self.hierarchical and self.engine == "reducer":
            raise FieldError("hierarchical", "runs on the Python buckets: set engine: auto or python")


@dataclass
class BytegradConfig(BSPConfig):
    """`bytegrad`: BSP whose buckets travel compressed through a scatter-gather (`compression.codec`,
    uint8 when it is `none`)."""

    policy: Literal["bytegrad"] = "bytegrad"  # type: ignore[assignment]


@dataclass
class QAdamConfig:
    """`qadam`: AdamW in full precision for `warmup_steps`, then a frozen second moment and the first
    moment agreed through `compression.codec` instead of the gradient."""

    policy: Literal["qadam"] = "qadam"
    warmup_steps: int = 100
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        _positive(self, "bucket_mb")
        if self.warmup_steps < 1:
            raise FieldError("warmup_steps", f"must be >= 1 (the second moment is frozen after it), got {self.warmup_steps}")


@dataclass
class LocalSGDConfig:
    """`local_sgd`: every member takes `h` local steps, then the replicas are averaged (weighted by the
    samples each trained); optimizer state stays local."""

    policy: Literal["local_sgd"] = "local_sgd"
    h: int = 8
    """Local steps per round."""

    def __post_init__(self) -> None:
        _at_least(self, "h", 1)


@dataclass
class DiLoCoConfig:
    """`diloco`: every `h` steps the members average the pseudo-gradient (global parameters minus
    local ones) and apply the outer optimizer (SGD with momentum) to the global parameters, which
    every member adopts; the configured optimizer is the inner one."""

    policy: Literal["diloco"] = "diloco"
    h: int = 16
    """Inner steps per round."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        _at_least(self, "h", 1)
        _positive(self, "outer_lr")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise FieldError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        if self.nesterov and self.outer_momentum == 0:
            raise FieldError("nesterov", "needs outer_momentum > 0 (set nesterov: false for plain outer SGD)")


@dataclass
class StreamingDiLoCoConfig(DiLoCoConfig):
    """`streaming_diloco`: DiLoCo with the parameters split into `fragments` synchronized at staggered
    steps (fragment f at steps (f + 1) * h / fragments, then every h); a fragment's all-reduce
    launches at step t and is merged at step t + `overlap` as alpha * outer + (1 - alpha) * local,
    so communication overlaps `overlap` local steps. With `overlap: 0` nothing ran meanwhile and the
    merge adopts the outer parameters (so `fragments: 1, overlap: 0` is `diloco`)."""

    policy: Literal["streaming_diloco"] = "streaming_diloco"  # type: ignore[assignment]
    fragments: int = 1
    overlap: int = 1
    alpha: float = 0.5
    """Weight of the outer parameters in the merge."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, "fragments", 1)
        if self.h % self.fragments:
            raise FieldError("fragments", f"must divide h = {self.h}, got {self.fragments}")
        if not 0 <= self.overlap < self.h // self.fragments:
            raise FieldError("overlap", f"must be in [0, h / fragments) = [0, {self.h // self.fragments}), got {self.overlap}")
        if not 0.0 <= self.alpha <= 1.0:
            raise FieldError("alpha", f"must be in [0, 1], got {self.alpha}")


@dataclass
class ASPConfig:
    """`asp`: every member pushes its gradient to the server and pulls fresh parameters, never waiting
    for the others; the server applies each push as it comes (one version each)."""

    policy: Literal["asp"] = "asp"


@dataclass
class SSPConfig:
    """`ssp`: as ASP, but the server applies a clock once every live member has pushed it (one step on
    their sum), and a member may pull clock c only once the version is at least c - s."""

    policy: Literal["ssp"] = "ssp"
    s: int = 3
    """Staleness bound in clocks: how far the fastest live member may run ahead of the slowest (0 is BSP)."""

    def __post_init__(self) -> None:
        _at_least(self, "s", 0)


@dataclass
class QuorumConfig:
    """`quorum` (backup workers): the server applies a clock once `k` members have pushed it; late
    pushes for that clock are dropped and their samples requeued."""

    policy: Literal["quorum"] = "quorum"
    k: int | None = None
    """Pushes that complete a clock; defaults to workers.count - 1 (one backup worker); k = n is BSP."""

    def __post_init__(self) -> None:
        if self.k is not None:
            _at_least(self, "k", 1)


@dataclass
class ElasticBSPConfig:
    """`elastic_bsp`: between barriers every member runs as in ASP; at a barrier every live member's
    push waits and the server applies them as one step, then everyone pulls. ZipLine places each
    barrier (each member's own iteration within the next `r`) where the predicted waiting is least."""

    policy: Literal["elastic_bsp"] = "elastic_bsp"
    r: int = 16
    """Lookahead: each barrier comes within a member's next `r` iterations; without a schedule from
    the coordinator (down, or late) the barrier is after exactly `r`. `r: 1` is BSP."""
    ewma: float = 0.3
    """Weight of the newest iteration interval in each member's predicted interval."""

    def __post_init__(self) -> None:
        _at_least(self, "r", 1)
        if not 0 < self.ewma <= 1:
            raise FieldError("ewma", f"must be in (0, 1], got {self.ewma}")


@dataclass
class ShadowConfig:
    """`shadow` (background synchronization): every member trains on its own replica and never waits;
    a background thread synchronizes the replicas, round after round, while the foreground trains."""

    policy: Literal["shadow"] = "shadow"
    method: Literal["ma", "easgd", "bmuf"] = "ma"
    """ma: average the replicas; bmuf: block momentum on the average; easgd: elastic pull to a central
    copy held by the job's server actor."""
    interval_s: float = 0.0
    """Seconds from the start of one round to the start of the next; 0: back to back."""
    alpha: float = 0.3
    """EASGD's elastic weight, in (0, 1]."""
    block_momentum: float = 0.0
    """BMUF's eta, in [0, 1)."""
    block_lr: float = 1.0
    """BMUF's zeta, > 0."""
    lease_block: int = 8
    """Steps' worth of samples a member leases per call to the dispenser (the next block is fetched
    in the background when half of the current one is used)."""

    def __post_init__(self) -> None:
        if self.method not in ("ma", "easgd", "bmuf"):
            raise FieldError("method", f"must be one of ma, easgd, bmuf, got {self.method!r}")
        if self.interval_s < 0:
            raise FieldError("interval_s", f"must be >= 0 (0: back to back), got {self.interval_s}")
        if not 0 < self.alpha <= 1:
            raise FieldError("alpha", f"must lie in (0, 1], got {self.alpha}")
        if not 0 <= self.block_momentum < 1:
            raise FieldError("block_momentum", f"must lie in [0, 1), got {self.block_momentum}")
        if self.block_lr <= 0:
            raise FieldError("block_lr", f"must be > 0, got {self.block_lr}")
        _at_least(self, "lease_block", 1)


TOPOLOGY_KINDS = ("aer", "complete", "exp", "matching", "one_peer_exp", "ring", "shift_one", "torus")
"""The gossip topologies of algorithms/topologies.py (a unit test keeps the two lists equal)."""


@dataclass
class TopologyConfig:
    """Who a gossip policy mixes with: a topology of algorithms/topologies.py, recomputed from (rank,
    world size) in every membership epoch and from the step for the time-varying ones."""

    kind: str = "ring"
    per_node: int = 1
    """`aer` only: workers per node (mix within a node, then one-peer exponential across nodes)."""
    seed: int = 0
    """`matching` only: the seed of its random pairings."""

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGY_KINDS:
            raise FieldError("kind", f"unknown topology {self.kind!r}; valid kinds: {', '.join(TOPOLOGY_KINDS)}")
        _at_least(self, "per_node", 1)
        _at_least(self, "seed", 0)

    def params(self) -> dict:
        """The parameters its kind takes (`aer`: per_node, `matching`: seed, the others none)."""
        return {"aer": {"per_node": self.per_node}, "matching": {"seed": self.seed}}.get(self.kind, {})


@dataclass
class DPSGDConfig:
    """`dpsgd` (D-PSGD): each step every member sends its parameters to its topology's peers while it
    computes its gradient g_i at its own x_i, then x_i <- (the configured optimizer's step from
    sum_j W_ij x_j with g_i); with plain SGD, x_i <- sum_j W_ij x_j - lr g_i."""

    policy: Literal["dpsgd"] = "dpsgd"
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    consensus_every: int = 10
    """Measure the consensus distance (1/n) sum_i ||x_i - x̄||^2 every this many steps (two all-reduces
    on the epoch's group: a global wait for every member); it goes into each member's history record
    as `consensus`. 0: never."""

    def __post_init__(self) -> None:
        _at_least(self, "consensus_every", 0)


@dataclass
class DAdamConfig(DPSGDConfig):
    """`dadam`: decentralized Adam with accumulation ("From promise to practice"): `dpsgd` whose local
    step is Adam on moments M, V of the member's own gradients that are folded only every `k` steps,
    from the mean of those k gradients (small local batches are noisy); each step uses
    M + (1 - b1) g and V + (1 - b2) g^2 with bias correction at ceil(t / k), and AdamW's decoupled
    weight decay. `k: 1` is plain AdamW. Needs optimizer.name: adamw (its lr, betas, eps, weight
    decay); moments never travel."""

    policy: Literal["dadam"] = "dadam"  # type: ignore[assignment]
    k: int = 4
    """Steps between folds of the running mean gradient into the moments."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, "k", 1)


STATIC_TOPOLOGIES = ("complete", "exp", "ring", "torus")
"""Topologies whose rows never change within a membership epoch (what `choco`'s public copies need)."""


@dataclass
class ChocoConfig(DPSGDConfig):
    """`choco` (CHOCO-SGD): low-precision gossip. Every member keeps public copies x̂ of itself and of
    its topology's peers. A step: the configured optimizer's step x <- x - lr g; q_i = Q(x_i - x̂_i)
    through `compression.codec` (exact differences when it is `none`); q_i goes to the peers, and every
    holder of a copy adds the same q_j to x̂_j; then x_i <- x_i + consensus_lr sum_j W_ij (x̂_j - x̂_i).
    The public copies start at zero in every membership epoch. Needs a static topology."""

    policy: Literal["choco"] = "choco"  # type: ignore[assignment]
    consensus_lr: float = 1.0
    """The consensus step size gamma_c in (0, 1]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.consensus_lr <= 1.0:
            raise FieldError("consensus_lr", f"must be in (0, 1], got {self.consensus_lr}")
        if self.topology.kind not in STATIC_TOPOLOGIES:
            raise FieldError("topology", f"choco needs a static topology (its public copies must see every message "
                                         f"of their owner): one of {', '.join(STATIC_TOPOLOGIES)}, got "
                                         f"{self.topology.kind!r}")


@dataclass
class TrialConfig:
    """`sync.auto`: try the shortlist online. The top `candidates` of the ranking that share BSP's
    replicated state (`bsp`, `bsp hierarchical`, `bytegrad`, `local_sgd`, `diloco`), and that are exact or
    have convergence factors for this workload, each run `trial_steps` committed steps in turn; the job
    then runs the one with the best measured step time times its factor. Each switch happens at a commit
    point (a step for the synchronous policies, a round for the periodic ones), without a restart."""

    trial_steps: int = 0
    """Steps each candidate runs (0: no trial, the model's pick runs from the start)."""
    candidates: int = 2
    """How many of the ranking's switchable candidates to try (at least 2)."""

    def __post_init__(self) -> None:
        if self.trial_steps < 0:
            raise FieldError("trial_steps", f"must be 0 (no trial) or a number of steps, got {self.trial_steps}")
        if self.candidates < 2:
            raise FieldError("candidates", f"a trial compares at least 2 candidates, got {self.candidates}")


@dataclass
class AutoConfig:
    """`auto`: the runtime model picks the policy when the job starts (orchestrator/planner.py): every
    applicable policy's predicted time to the target on `network:` (time per step where no convergence
    factor was measured), from the compute time of one step measured on the workload; the job's first
    event and its start line say what was picked and why. `python -m orchestrator plan` prints the same
    table without starting anything. With `auto.trial_steps` the job then tries its shortlist online
    and runs the best measured (docs/lab.md)."""

    policy: Literal["auto"] = "auto"
    candidates: list[str] = field(default_factory=list)
    """Policies (or the plan table's labels, e.g. `bsp hierarchical`) to choose among; empty: all that apply."""
    auto: TrialConfig = field(default_factory=TrialConfig)
    """The online trial (`trial_steps`, `candidates`); off unless `trial_steps` is set."""


@dataclass(frozen=True)
class PolicyRow:
    """One policy, declared once (`POLICIES`): every other list of policies derives from these rows."""

    name: str
    """`sync.policy`."""
    knobs: type
    """Its config dataclass (the `sync:` keys it takes)."""
    kind: str
    """Its kind (algorithms/kinds.py `Kind`): what it means to the coordinator."""
    module: str
    """The `algorithms` module whose `Algorithm` class registers it (algorithms/base.py imports it)."""
    codec: bool
    """Its collectives take `compression.codec` (the others refuse one, naming the key)."""
    cost_model: str | None
    """The runtime model's family for it (algorithms/runtime_model.py `predict`): `synchronous`,
    `periodic`, `gossip` or `background`; None: not modelled, so `plan` and `auto` never weigh it (the
    server kinds: their traffic is Ray's, which neither the model nor the lab sees)."""
    server: bool = False
    """Run by a parameter server (actors/parameter_server.py): the `server:` section applies."""
    switchable: bool = False
    """An online trial (`sync.auto`) may switch to or from it mid-run: it holds BSP's replicated state at
    its commit points (the same parameters on every member after a step or a round), so a switch at one
    loses and repeats no sample (orchestrator/planner.py `SWITCHABLE`)."""


POLICIES: tuple[PolicyRow, ...] = (
    PolicyRow("bsp", BSPConfig, "synchronous", "algorithms.allreduce", True, "synchronous", switchable=True),
    PolicyRow("bytegrad", BytegradConfig, "synchronous", "algorithms.allreduce", True, "synchronous", switchable=True),
    PolicyRow("qadam", QAdamConfig, "synchronous", "algorithms.qadam", True, "synchronous"),
    PolicyRow("local_sgd", LocalSGDConfig, "periodic", "algorithms.periodic", True, "periodic", switchable=True),
    PolicyRow("diloco", DiLoCoConfig, "periodic", "algorithms.periodic", True, "periodic", switchable=True),
    PolicyRow("streaming_diloco", StreamingDiLoCoConfig, "periodic", "algorithms.periodic", True, "periodic"),
    PolicyRow("asp", ASPConfig, "server", "algorithms.server_policies", False, None, server=True),
    PolicyRow("ssp", SSPConfig, "server", "algorithms.server_policies", False, None, server=True),
    PolicyRow("quorum", QuorumConfig, "server", "algorithms.server_policies", False, None, server=True),
    PolicyRow("elastic_bsp", ElasticBSPConfig, "server", "algorithms.server_policies", False, None, server=True),
    PolicyRow("shadow", ShadowConfig, "background", "algorithms.shadow", False, "background"),
    PolicyRow("dpsgd", DPSGDConfig, "decentralized", "algorithms.gossip", True, "gossip"),
    PolicyRow("dadam", DAdamConfig, "decentralized", "algorithms.gossip", True, "gossip"),
    PolicyRow("choco", ChocoConfig, "decentralized", "algorithms.gossip", True, "gossip"),
)
"""The policy table: the one place a policy is declared. Adding a policy is its module (an `Algorithm`
registered under `name`), its config class above, its row here, and its tests; the schema, the kinds,
the registry, the runtime model and the planner read the rows (docs/architecture.md walks one through)."""
POLICY_TABLE: dict[str, PolicyRow] = {row.name: row for row in POLICIES}
SYNC_POLICIES: dict[str, type] = {row.name: row.knobs for row in POLICIES}
"""`sync.policy` -> its config dataclass (its knobs); algorithms/ registers one Algorithm for each that runs."""
SyncConfig = (BSPConfig | BytegradConfig | QAdamConfig | LocalSGDConfig | DiLoCoConfig | StreamingDiLoCoConfig
              | ASPConfig | SSPConfig | QuorumConfig | ElasticBSPConfig | ShadowConfig | DPSGDConfig | DAdamConfig
              | ChocoConfig | AutoConfig)
"""The type of `JobConfig.sync` for the type checker (a test checks it names every row's knobs)."""
SERVER_POLICIES = frozenset(row.name for row in POLICIES if row.server)
"""Policies run by a parameter server (actors/parameter_server.py): the `server:` section applies."""
NOT_WIRED: frozenset[str] = frozenset()
"""Policies whose settings the schema checks but that cannot run yet: a job naming one is refused
(exit 2) rather than started. None today."""


def _positive(obj: Any, name: str) -> None:
    if getattr(obj, name) <= 0:
        raise FieldError(name, f"must be positive, got {getattr(obj, name)}")


def _at_least(obj: Any, name: str, low: int) -> None:
    if getattr(obj, name) < low:
        raise FieldError(name, f"must be at least {low}, got {getattr(obj, name)}")


@dataclass
class ServerConfig:
    """The parameter server of the server policies (asp, ssp, quorum)."""

    shards: int = 1
    """Server actors, each holding a contiguous range of the flat parameters and its optimizer state."""
    cpus: float = 1.0
    """Logical CPUs per server actor."""
    snapshot_every: int = 50
    """Snapshot the server's whole state to the run directory every this many versions (what a
    restarted server resumes from)."""

    def __post_init__(self) -> None:
        _at_least(self, "shards", 1)
        _at_least(self, "snapshot_every", 1)
        if self.cpus < 0:
            raise FieldError("cpus", f"must not be negative, got {self.cpus}")


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number written the way people write them (1e-5, 3., .5), for float fields."""

CODECS = ("none", "fp16", "bf16", "uint8", "onebit")
COMPRESSING_POLICIES = tuple(row.name for row in POLICIES if row.codec)
"""Policies whose collectives take a codec so far (the others refuse one, naming the key)."""


@dataclass
class CompressionConfig:
    """How gradients (or a periodic round's payload) travel: `none`, or a codec through a compressed
    scatter-gather all-reduce."""

    codec: str = "none"
    """`fp16`, `bf16`, `uint8` (per-chunk min/max, 256 levels) or `onebit` (signs scaled by the mean
    magnitude; needs `feedback`)."""
    feedback: bool = False
    """Error feedback on both halves of the scatter-gather (what compression lost is added back next
    step, or next round)."""

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise FieldError("codec", f"unknown codec {self.codec!r}; valid: {', '.join(CODECS)}")
        if self.codec == "onebit" and not self.feedback:
            raise FieldError("feedback", "codec onebit needs feedback: true (a 1-bit code drifts without it)")


@dataclass
class CheckpointConfig:
    every_steps: int | None = None
    """Write a checkpoint every this many committed steps (none when unset)."""
    keep: int = 3
    """How many checkpoints to keep."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise FieldError("every_steps", f"must be at least 1, got {self.every_steps}")
        if self.keep < 1:
            raise FieldError("keep", f"must be at least 1, got {self.keep}")


@dataclass
class TrackingConfig:
    metrics: bool = True
    """Export the job's metrics through Ray's metrics agent (`ray.util.metrics`: Prometheus, Ray's dashboard)."""
    per_worker_metrics: bool = False
    """Also export series per slot: each member's step-time ratio and step-time histogram (some 15 series a
    member; off, the job-wide step-time histogram and the slowest member's ratio stand for them)."""
    tensorboard: str | None = None
    """A directory for TensorBoard event files (the committed step is the global step); a relative path
    is inside the run directory. None: no TensorBoard."""
    report: bool | None = None
    """Draw the run report (`report.png` in the run directory) when the job ends (needs matplotlib). Unset:
    drawn unless the environment says ORCHESTRATOR_REPORT=0 (the test suite does: it runs many jobs)."""

    def __post_init__(self) -> None:
        if self.tensorboard is not None:
            import importlib.util

            if not self.tensorboard.strip():
                raise FieldError("tensorboard", "must be a directory; leave it out for no TensorBoard")
            if importlib.util.find_spec("tensorboardX") is None:
                raise FieldError("tensorboard", "needs tensorboardX: pip install 'elastic-orchestrator[tracking]'")


@dataclass
class TargetConfig:
    metric: str = "accuracy"
    value: float = 0.0
    mode: Literal["max", "min"] = "max"
    """`max`: stop once metric >= value; `min`: once metric <= value."""


@dataclass
class StopConfig:
    max_steps: int | None = None
    target: TargetConfig | None = None
    time_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_steps is None and self.target is None and self.time_s is None:
            raise FieldError("max_steps", "set at least one of stop.max_steps, stop.target, stop.time_s")
        if self.max_steps is not None and self.max_steps < 1:
            raise FieldError("max_steps", f"must be at least 1, got {self.max_steps}")
        if self.time_s is not None and self.time_s <= 0:
            raise FieldError("time_s", f"must be positive, got {self.time_s}")


@dataclass
class JitterSpec:
    """A random factor on each step's time: lognormal with median 1, drawn from (seed, slot, step)."""

    dist: Literal["lognormal"] = "lognormal"
    sigma: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dist != "lognormal":
            raise FieldError("dist", f"must be lognormal, got {self.dist!r}")
        if not 0 <= self.sigma <= 3:
            raise FieldError("sigma", f"must be in [0, 3], got {self.sigma}")


@dataclass
class StragglerFault:
    slot: str = ""
    slowdown: float = 1.0
    """Each step takes this many times as long (a sleep after compute)."""
    delay_s: float = 0.0
    """Each step also sleeps this long: a fixed compute time, so a run's pace is the same on fast
    and slow machines."""
    jitter: JitterSpec | None = None
    """The step's time (computed x slowdown + delay_s) is multiplied by a seeded random factor; a
    factor below 1 cannot shorten the computation itself, only the sleep."""
    from_step: int = 0
    """Slow only once this many steps are committed (a straggler that appears mid-run; numbered as
    `kills[].step`). Entries for one slot combine: the largest slowdown and delay_s of those in force."""

    def __post_init__(self) -> None:
        _check_slot(self.slot)
        if self.from_step < 0:
            raise FieldError("from_step", f"must not be negative, got {self.from_step}")
        if self.slowdown < 1.0:
            raise FieldError("slowdown", f"must be >= 1.0, got {self.slowdown}")
        if self.delay_s < 0:
            raise FieldError("delay_s", f"must not be negative, got {self.delay_s}")


@dataclass
class KillFault:
    slot: str = ""
    step: int = 0
    """The step it fires at; with `at: join`, the first join of that slot at or after this step."""
    at: Literal["allreduce", "checkpoint", "join", "user_exception", "step", "vote"] = "step"
    """`vote`: the member loses the result of that step's commit vote while the others commit it
    (a split commit, as when a peer fails mid-reduction); `how` does not apply."""
    how: Literal["sigkill", "exit", "actor_kill", "raise", "hang"] = "sigkill"
    """`hang`: the step never ends (the process still answers control calls)."""
    repeat: bool = False

    def __post_init__(self) -> None:
        _check_slot(self.slot)
        if self.step < 0:
            raise FieldError("step", f"must not be negative, got {self.step}")
        if self.at == "user_exception":
            self.how = "raise"


@dataclass
class CoordinatorFault:
    """Kill the coordinator's process at an exact point of the protocol (Ray restarts it)."""

    at: Literal["publish", "stop", "recover"] = "publish"
    """`publish`: right after plan `version` has reached the workers, before the coordinator has
    saved it; `stop`: after it has saved a decision to stop (state STOPPING), while it receives the
    next progress report (whose records are lost with it); `recover`: a restarted coordinator, as it
    begins to re-attach its workers (it dies again before it has seen any of them)."""
    version: int = 0

    def __post_init__(self) -> None:
        if self.at == "publish" and self.version < 1:
            raise FieldError("version", f"must name a plan version (1 or more) for at: publish, got {self.version}")


@dataclass
class ScaleFault:
    """A scale request at a named step: once the job has committed `step`, the coordinator scales it to
    `count` workers, as `scale` from a shell would (tests and experiments: the order of a scale and
    other faults is written in the config, not left to when a driver's call arrives)."""

    step: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if self.step < 1:
            raise FieldError("step", f"must be 1 or more (a committed step), got {self.step}")
        if self.count < 1:
            raise FieldError("count", f"must be 1 or more, got {self.count}")


@dataclass
class DelayedPush:
    """A server policy's push held in flight (a slow network): the parameter server takes the first
    push of `slot` for clock `clock` (that slot's `clock`-th push, from 0) `delay_s` seconds after it
    was sent. The worker waits for the answer meanwhile; past `workers.hang_timeout_s` it is evicted,
    so the push arrives from an incarnation that is no longer a member."""

    slot: str = ""
    clock: int = 0
    delay_s: float = 1.0

    def __post_init__(self) -> None:
        _check_slot(self.slot)
        if self.clock < 0:
            raise FieldError("clock", f"must not be negative, got {self.clock}")
        if self.delay_s <= 0:
            raise FieldError("delay_s", f"must be positive, got {self.delay_s}")


@dataclass
class FaultsConfig:
    stragglers: list[StragglerFault] = field(default_factory=list)
    kills: list[KillFault] = field(default_factory=list)
    coordinator: list[CoordinatorFault] = field(default_factory=list)
    scale: list[ScaleFault] = field(default_factory=list)
    """Scale requests at named steps (see `ScaleFault`), each once."""
    delayed_pushes: list[DelayedPush] = field(default_factory=list)
    """Server policies only: pushes the parameter server takes late (see `DelayedPush`)."""
    comm_latency_s: float = 0.0
    """A modelled network latency: every collective of every group (the background kind's too)
    completes no sooner than this many seconds after its launch (benchmarks: a slow network on one
    machine). Overlapped operations overlap their latencies, as on a real network."""
    record_samples: bool = False
    """Each worker appends `step membership_epoch id id ...` for every step it commits to
    `samples/<slot>.txt` (tests); a step counts in the epoch that history gives for it."""
    checkpoint_store_s: float = 0.0
    """Storing each checkpoint takes at least this long (a slow upload), off the coordinator's event loop."""
    checkpoint_fail_s: float = 0.0
    """Every try to store a checkpoint fails for this long after the coordinator starts (a store that is
    down): each failure is a `checkpoint_failed` event, and the try is made again with backoff."""

    def __post_init__(self) -> None:
        for knob in ("comm_latency_s", "checkpoint_store_s", "checkpoint_fail_s"):
            if getattr(self, knob) < 0:
                raise FieldError(knob, f"must not be negative, got {getattr(self, knob)}")


@dataclass
class LinkConfig:
    """One kind of link of the lab's emulated network."""

    mbit: float | None = None
    """Bandwidth in Mbit/s, each direction, shaped by the kernel (`tc` htb); none: unshaped loopback."""
    latency_ms: float = 0.0
    """One-way latency, modelled in the transport (no netem here): every collective whose members span
    the link completes no sooner than its sequential message rounds times this after its launch."""

    def __post_init__(self) -> None:
        if self.mbit is not None and self.mbit <= 0:
            raise FieldError("mbit", f"must be positive (or unset for unshaped), got {self.mbit}")
        if self.latency_ms < 0:
            raise FieldError("latency_ms", f"must not be negative, got {self.latency_ms}")


@dataclass
class PairLink(LinkConfig):
    """A per-pair override: the link between virtual nodes `a` and `b` (both directions)."""

    a: int = 0
    b: int = 1


@dataclass
class NetworkConfig:
    """An emulated multi-node network on one machine (the lab; orchestrator/lab.py). Slot `w<i>` runs on
    virtual node `i // workers_per_node` (modulo `nodes`), whose address is the `i`-th host of `subnet`
    (127.77.0.1 for node 0 by default); the kernel shapes traffic between different nodes' addresses.
    `nodes: 0` (the default) is no lab. With `emulate: false` the section describes a real cluster's
    links instead, for `plan` and `sync.policy: auto` to rank on (as told): nothing is shaped, no lab
    comes up, and the workers run where Ray places them."""

    nodes: int = 0
    workers_per_node: int = 1
    intra: LinkConfig = field(default_factory=LinkConfig)
    """Links between workers of one node (unshaped unless set)."""
    inter: LinkConfig = field(default_factory=lambda: LinkConfig(mbit=1000.0, latency_ms=0.1))
    """Links between nodes, unless `links` names the pair."""
    links: list[PairLink] = field(default_factory=list)
    subnet: str = "127.77.0.0/24"
    """Loopback addresses of the virtual nodes (all of 127/8 is this machine); nothing outside is shaped."""
    emulate: bool = True
    """True: the lab emulates this network on this machine. False: it describes the real cluster the job
    runs on (`nodes` of `workers_per_node` ranks each, `inter`/`intra`/`links` as measured or specified
    elsewhere), which only the planner reads."""

    def __post_init__(self) -> None:
        _at_least(self, "nodes", 0)
        _at_least(self, "workers_per_node", 1)
        match = re.fullmatch(r"127\.(\d{1,3})\.(\d{1,3})\.0/24", self.subnet)
        if not match or any(int(g) > 255 for g in match.groups()) or self.subnet.startswith("127.0.0."):
            raise FieldError("subnet", f"must be a /24 inside 127.0.0.0/8 other than 127.0.0.0/24 (e.g. "
                                       f"127.77.0.0/24), got {self.subnet!r}")
        if self.nodes > 250:
            raise FieldError("nodes", f"at most 250 virtual nodes fit a /24, got {self.nodes}")
        for i, link in enumerate(self.links):
            if not (0 <= link.a < self.nodes and 0 <= link.b < self.nodes) or link.a == link.b:
                raise FieldError(f"links[{i}]", f"a and b must be two different nodes of 0..{self.nodes - 1}, "
                                                f"got {link.a} and {link.b}")

    @property
    def enabled(self) -> bool:
        """A network is described (emulated by the lab, or told for a real cluster)."""
        return self.nodes > 0

    @property
    def lab(self) -> bool:
        """The lab emulates it on this machine (shaping, virtual node addresses, modelled latency)."""
        return self.nodes > 0 and self.emulate

    def address(self, node: int) -> str:
        return self.subnet.rsplit(".", 1)[0] + f".{node + 1}"

    def node_of(self, slot: str) -> int:
        return (int(slot[1:]) // self.workers_per_node) % self.nodes

    def link(self, a: int, b: int) -> LinkConfig:
        """The link between nodes `a` and `b` (`intra` when they are the same node)."""
        if a == b:
            return self.intra
        for pair in self.links:
            if {pair.a, pair.b} == {a, b}:
                return pair
        return self.inter


@dataclass
class CommConfig:
    timeout_s: float = 10.0
    """One timeout for every collective, the store and group construction."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    sign_rendezvous: bool = True
    """Each job's rendezvous values are signed with a secret only its actors hold, and a value without
    that signature is refused. `false` exists to measure what signing costs (benchmarks/startup.py);
    without it, anything that reaches the coordinator's store port can steer a job's groups."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise FieldError("timeout_s", f"must be positive, got {self.timeout_s}")


@dataclass
class RayConfig:
    address: str | None = None
    """Ray address; none starts (or reuses) a local Ray."""
    namespace: str = "orchestrator"
    num_cpus: int | None = None
    """Logical CPUs of a local Ray; defaults to at least workers.max x workers.cpus."""
    coordinator_resources: dict = field(default_factory=dict)
    """Custom resources the coordinator asks for (a small amount of each), e.g. `{coordinator: 0.01}`.
    Empty: the head node, which lives as long as the cluster. Name a resource that several nodes have
    to let Ray restart the coordinator on another node when its node is lost; its run files must then
    be on shared storage (`storage: s3://...`)."""

    def __post_init__(self) -> None:
        for name, amount in self.coordinator_resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount <= 1:
                raise FieldError(f"coordinator_resources.{name}", f"an amount in (0, 1] (got {amount!r})")


@dataclass
class JobConfig:
    """The whole job, one YAML file."""

    name: str = ""
    seed: int = 0
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sync: SyncConfig = field(default_factory=BSPConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    stop: StopConfig = field(default_factory=lambda: StopConfig(max_steps=100))
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    eval_every: int = 50
    """Evaluate (rank 0, on workload.eval_data) every this many steps; 0 disables."""
    run_dir: str | None = None
    """Absolute run directory root; default ~/orchestrator-runs. Relative paths are resolved at load."""
    storage: str | None = None
    """Where the job keeps what outlives a node: a local path (then it is the run root, as `run_dir`),
    or a URI (`s3://bucket/prefix?endpoint_override=...`, `gs://...`, any fsspec scheme). With a URI,
    the run's files are written to the local run directory and copied there as they change;
    checkpoints, server snapshots and `--resume` use it directly (actors/storage.py)."""
    storage_options: dict = field(default_factory=dict)
    """Options of the storage taken from the environment, never written down: a mapping of an option
    name (`access_key`, `secret_key`, `session_token`, an fsspec filesystem's `account_key`, ...) to the
    name of an environment variable that holds its value on every node, e.g.
    `{access_key: MY_S3_KEY, secret_key: MY_S3_SECRET}`. Credentials written in the URI's query are
    moved here when the config is read (into `ORCHESTRATOR_STORAGE_<OPTION>` of the driver's
    environment, and the job's Ray runtime environment), so no copy of them is kept anywhere."""
    progress_every_s: float = 5.0
    policy_choice: str = ""
    """Set by `sync.policy: auto` when the job starts: the pick and its reason (the job's first event)."""
    policy_trial: dict = field(default_factory=dict)
    """Set by `sync.policy: auto` with `sync.auto.trial_steps`: `{steps, candidates}`, the candidates the
    coordinator tries in order, each `{label, sync, compression, step_s, factor}` (the first is the
    config's `sync:`); empty: no trial."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    """Python logging level of the coordinator (`coordinator.log` in the run directory), the workers
    (`workers/<slot>.log`) and the driver; `--log-level` on the command line sets it too."""

    def __post_init__(self) -> None:
        if self.sync.policy in ("qadam", "dadam") and self.optimizer.name != "adamw":
            raise FieldError("optimizer.name", f"{self.sync.policy} is Adam: set optimizer.name: adamw "
                                               f"(got {self.optimizer.name})")
        if self.compression.codec != "none" and self.sync.policy not in COMPRESSING_POLICIES:
            raise FieldError("compression.codec", f"policy {self.sync.policy!r} does not compress yet; "
                                                  f"{', '.join(COMPRESSING_POLICIES)} do")
        if self.compression.codec == "onebit" and self.sync.policy in ("dpsgd", "dadam"):
            raise FieldError("compression.codec", f"{self.sync.policy} sends the parameters themselves, and one bit "
                                                  f"per parameter loses them; use fp16, bf16 or uint8, or policy "
                                                  f"choco, which sends differences to public copies")
        gpus = self.workers.gpus
        if getattr(self.sync, "engine", "auto") == "reducer":
            if self.sync.policy != "bsp" or self.compression.codec != "none":
                raise FieldError("sync.engine", "the reducer sends plain gradients: codecs (and bytegrad) run on "
                                                "engine: python (or auto)")
            if gpus > 0 and (gpus != int(gpus) or self.comm.backend == "gloo"):
                raise FieldError("sync.engine", "the reducer runs on gloo with CPU parameters or on NCCL with whole "
                                                "GPUs; GPU workers over gloo use engine: auto or python")
        if gpus > 0 and gpus != int(gpus) and self.comm.backend != "gloo":
            raise FieldError("comm.backend", f"NCCL needs whole GPUs (workers.gpus = {gpus:g}: one GPU cannot hold "
                                             f"two NCCL ranks); set comm.backend: gloo to share GPUs, or whole gpus")
        if self.comm.backend == "nccl" and gpus <= 0:
            raise FieldError("comm.backend", "nccl needs workers.gpus >= 1")
        for option, variable in self.storage_options.items():
            if not isinstance(variable, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", variable):
                raise FieldError(f"storage_options.{option}", f"names the environment variable that holds the "
                                                              f"value (letters, digits, '_'), got {variable!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name or ""):
            raise FieldError("name", f"must be 1-64 characters of letters, digits, '_', '.', '-', got {self.name!r}")
        if self.eval_every < 0:
            raise FieldError("eval_every", f"must not be negative, got {self.eval_every}")
        self._check_server_policy()
        if self.network.lab:
            self._check_network()
        slots = {f"w{i}" for i in range(self.workers.max or self.workers.count)}
        for i, kill in enumerate(self.faults.kills):
            if kill.slot not in slots:
                raise FieldError(f"faults.kills[{i}].slot", f"{kill.slot!r} is not a slot of this job (w0..w{len(slots) - 1})")
        for i, scale in enumerate(self.faults.scale):
            if not (self.workers.min <= scale.count <= (self.workers.max or self.workers.count)):
                raise FieldError(f"faults.scale[{i}].count", f"{scale.count} is outside [workers.min, workers.max] = "
                                                             f"[{self.workers.min}, {self.workers.max or self.workers.count}]")
        for i, delayed in enumerate(self.faults.delayed_pushes):
            if delayed.slot not in slots:
                raise FieldError(f"faults.delayed_pushes[{i}].slot", f"{delayed.slot!r} is not a slot of this job "
                                                                     f"(w0..w{len(slots) - 1})")
            if self.sync.policy not in SERVER_POLICIES:
                raise FieldError(f"faults.delayed_pushes[{i}]", f"policy {self.sync.policy!r} does not push to a "
                                                                f"parameter server ({', '.join(sorted(SERVER_POLICIES))} do)")

    def _check_server_policy(self) -> None:
        if isinstance(self.sync, QuorumConfig):
            if self.sync.k is None:
                self.sync.k = max(1, self.workers.count - 1)
            if self.sync.k > (self.workers.max or self.workers.count):
                raise FieldError("sync.k", f"must not exceed workers.max = {self.workers.max}, got {self.sync.k}")
        if self.sync.policy in SERVER_POLICIES and self.workers.batch_mode != "keep_global":
            raise FieldError("workers.batch_mode", f"policy {self.sync.policy!r} keeps the global batch (the server "
                                                   f"scales by it): set workers.batch_mode: keep_global")
        if self.sync.policy in NOT_WIRED:
            raise FieldError("sync.policy", f"policy {self.sync.policy!r} is not available yet: it runs in process "
                                            f"only, its end-to-end runs under Ray are not verified")

    def _check_network(self) -> None:
        if self.sync.policy in SERVER_POLICIES:
            raise FieldError("network", f"policy {self.sync.policy!r} pushes and pulls through Ray's object "
                                        f"transport, which the lab does not shape; the lab runs the policies "
                                        f"whose traffic is their group's (all but {', '.join(sorted(SERVER_POLICIES))})")
        if self.workers.gpus > 0 or self.comm.backend == "nccl":
            raise FieldError("network", "the lab shapes TCP on loopback: it runs gloo workers on CPU")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_slot(slot: str) -> None:
    if not re.fullmatch(r"w\d+", slot or ""):
        raise FieldError("slot", f"must name a slot like 'w1', got {slot!r}")


# --------------------------------------------------------------------------- parser
_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def parse(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from plain YAML data, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"{key_path}: unknown key; allowed here: {', '.join(names)}")
        kwargs[key] = _convert(hints[key], value, key_path)
    try:
        return cls(**kwargs)
    except FieldError as err:
        key_path = f"{path}.{err.field_name}" if path else err.field_name
        raise ConfigError(f"{key_path}: {err.message}") from None


def _parse_sync(data: Any, path: str) -> Any:
    """`sync:` is parsed by its `policy`: each policy has its own knobs."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {_show(data)}")
    policy = data.get("policy", "bsp")
    if policy not in SYNC_POLICIES and policy != "auto":
        raise ConfigError(f"{path}.policy: unknown policy {policy!r}; available: {', '.join(sorted(SYNC_POLICIES))}, "
                          f"or auto")
    cls = AutoConfig if policy == "auto" else SYNC_POLICIES[policy]
    knobs = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in knobs:
            raise ConfigError(f"{path}.{key}: is not a knob of policy {policy!r}; its knobs: {', '.join(knobs)}")
    return parse(cls, data, path)


def _convert(tp: Any, value: Any, path: str) -> Any:
    if tp is SyncConfig:
        return _parse_sync(value, path)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {_show(value)} is not allowed; choose one of: {', '.join(map(str, allowed))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        parts = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(parts):
            raise ConfigError(f"{path}: expected a list of {len(parts)} numbers, got {_show(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(parts, value)))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # an annotation: a dataclass here is a class
        return parse(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string; it is a number here
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_show(value)}")
        return value
    raise TypeError(f"schema type {tp!r} at {path} has no converter")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "nothing (null)"


# --------------------------------------------------------------------------- status and results
JobState = Literal["STARTING", "RUNNING", "RESHAPING", "PAUSED", "STOPPING", "STOPPED", "FINISHED", "FAILED"]
TERMINAL_STATES = ("STOPPED", "FINISHED", "FAILED")


@dataclass(frozen=True)
class MemberStatus:
    slot: str
    rank: int
    node: str
    pid: int
    state: str
    """starting / ready / training / leaving / left / finished / dead / failed / hung / retired / stopped"""
    actor_id: str = ""
    cause: str = ""
    """Why it is hung, failed or retired."""
    node_id: str = ""


@dataclass(frozen=True)
class Event:
    """A coordinator state transition or a reshape, with its reason."""

    time: float
    kind: str
    """transition / reshape / failure / checkpoint / straggler / fault / info"""
    reason: str
    state_from: str | None = None
    state_to: str | None = None
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class JobStatus:
    name: str
    run_id: str
    state: str
    step: int
    membership_epoch: int
    world_size: int
    members: tuple[MemberStatus, ...]
    loss: float | None
    throughput: float | None
    """Committed steps per second over the last few seconds."""
    cause: str | None
    run_dir: str
    metrics: dict = field(default_factory=dict)
    reshapes: tuple[Event, ...] = ()
    departed: tuple[MemberStatus, ...] = ()
    """Earlier incarnations that died, hung, failed or were retired, with their causes (newest last)."""
    incarnation: int = 0
    """How often the coordinator has been restarted (it carries on each time)."""
    coordinator_pid: int = 0
    started_at: float = 0.0
    """When the job started (its coordinator was created), as a Unix time."""
    ended_at: float | None = None
    """When it reached STOPPED, FINISHED or FAILED."""
    stragglers: dict = field(default_factory=dict)
    """Training members whose step time is above 1.5x the median, with that ratio (slot -> ratio)."""
    server: dict = field(default_factory=dict)
    """Server policies: the parameter server's version, incarnation, restarts, staleness histogram
    (updates by staleness), refused pushes by reason and lease counts (samples leased, applied,
    dropped, requeued, outstanding)."""
    topology: dict = field(default_factory=dict)
    """Gossip policies: the topology's kind, the world size it is built for, and its spectral gap there
    (1 - rho^(1/period), algorithms/topologies.py)."""
    tokens_per_s: float | None = None
    """Tokens per second over the last few seconds, all members together: workloads that count tokens
    (`tokens_per_sample`, the language models); None for the others."""
    spares: tuple[dict, ...] = ()
    """Hot spares (`workers.spares`): name, state (starting or ready), pid, node and started_at (time.time())
    of each."""
    checkpoint: dict = field(default_factory=dict)
    """The last durable checkpoint of this run: `step` and `time` (time.time()) once one is stored, and
    `failures`, the tries to store one that failed (each a `checkpoint_failed` event); empty before any."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _repr_html_(self) -> str:
        """Jupyter's view (core/display.py)."""
        from core.display import status_html

        return status_html(self)

    @classmethod
    def from_dict(cls, data: dict) -> JobStatus:
        data = dict(data)
        data["members"] = tuple(MemberStatus(**m) for m in data.get("members", ()))
        data["reshapes"] = tuple(Event(**e) for e in data.get("reshapes", ()))
        data["departed"] = tuple(MemberStatus(**m) for m in data.get("departed", ()))
        return cls(**data)


@dataclass(frozen=True)
class JobResult:
    name: str
    run_id: str
    state: str
    step: int
    cause: str | None
    metrics: dict
    run_dir: str
    elapsed_s: float
    """The job's run time: from its start to its end (not to when `wait()` returned)."""

    @property
    def ok(self) -> bool:
        return self.state == "FINISHED"
