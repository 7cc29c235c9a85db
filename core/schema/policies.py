"""The sync policies: each policy's knobs (its `sync:` keys) and the one policy table, `POLICIES`.

A policy is declared once, as a `PolicyRow` of `POLICIES`; every other list of policies (the knobs by
name, the server policies, the compressing ones) derives from the rows here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.schema.errors import DAY_S, FieldError, at_least, positive, within


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
        positive(self, "bucket_mb")
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
        positive(self, "bucket_mb")
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
        at_least(self, "h", 1)


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
        at_least(self, "h", 1)
        positive(self, "outer_lr")
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
        at_least(self, "fragments", 1)
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
        at_least(self, "s", 0)


@dataclass
class QuorumConfig:
    """`quorum` (backup workers): the server applies a clock once `k` members have pushed it; late
    pushes for that clock are dropped and their samples requeued."""

    policy: Literal["quorum"] = "quorum"
    k: int | None = None
    """Pushes that complete a clock; defaults to workers.count - 1 (one backup worker); k = n is BSP."""

    def __post_init__(self) -> None:
        if self.k is not None:
            at_least(self, "k", 1)


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
        at_least(self, "r", 1)
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
    """Seconds from the start of one round to the start of the next; 0: back to back. In [0, 86400]:
    rounds a day apart are no synchronization (`errors.DAY_S`)."""
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
        within(self, "interval_s", 0.0, DAY_S, unit=" s (0: back to back)")
        if not 0 < self.alpha <= 1:
            raise FieldError("alpha", f"must lie in (0, 1], got {self.alpha}")
        if not 0 <= self.block_momentum < 1:
            raise FieldError("block_momentum", f"must lie in [0, 1), got {self.block_momentum}")
        if self.block_lr <= 0:
            raise FieldError("block_lr", f"must be > 0, got {self.block_lr}")
        at_least(self, "lease_block", 1)


TOPOLOGY_KINDS = ("aer", "complete", "exp", "matching", "one_peer_exp", "ring", "shift_one", "torus")
"""The gossip topologies of algorithms/rules/topologies.py (a unit test keeps the two lists equal)."""


@dataclass
class TopologyConfig:
    """Who a gossip policy mixes with: a topology of algorithms/rules/topologies.py, recomputed from (rank,
    world size) in every membership epoch and from the step for the time-varying ones."""

    kind: str = "ring"
    per_node: int = 1
    """`aer` only: workers per node (mix within a node, then one-peer exponential across nodes)."""
    seed: int = 0
    """`matching` only: the seed of its random pairings."""

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGY_KINDS:
            raise FieldError("kind", f"unknown topology {self.kind!r}; valid kinds: {', '.join(TOPOLOGY_KINDS)}")
        at_least(self, "per_node", 1)
        at_least(self, "seed", 0)

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
        at_least(self, "consensus_every", 0)


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
        at_least(self, "k", 1)


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
    max_share: float = 0.25
    """The trial may take at most this share of the job's predicted steps (`stop.max_steps`, or BSP's steps
    to the target times the first candidate's factor where factors apply): candidates are dropped from the
    end of the shortlist until it fits, and with fewer than 2 left no trial runs (the start line says
    why). A job whose length is unknown (`stop.time_s` only, or a target without factors) runs the trial
    as asked. 1: as long as the job."""

    def __post_init__(self) -> None:
        if self.trial_steps < 0:
            raise FieldError("trial_steps", f"must be 0 (no trial) or a number of steps, got {self.trial_steps}")
        if self.candidates < 2:
            raise FieldError("candidates", f"a trial compares at least 2 candidates, got {self.candidates}")
        if not 0 < self.max_share <= 1:
            raise FieldError("max_share", f"must be a share of the job's steps in (0, 1], got {self.max_share}")


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


RING: dict[str, object] = {"kind": "ring"}


@dataclass(frozen=True)
class Weighed:
    """One configuration of a policy that `plan` and `auto` weigh (orchestrator/planning/candidates.py):
    its label, its `sync:` keys besides the policy, its codec, and the jobs it applies to."""

    label: str
    knobs: dict[str, object] = field(default_factory=dict)
    codec: str = "none"
    when: Literal["always", "multi_node", "sgd", "adamw"] = "always"
    """`multi_node`: where the ranks span more than one node; `sgd`/`adamw`: with that optimizer (the
    Adam-based policies with AdamW, their SGD counterparts otherwise)."""


@dataclass(frozen=True)
class PolicyRow:
    """One policy, declared once (`POLICIES`): every other list of policies derives from these rows."""

    name: str
    """`sync.policy`."""
    knobs: type
    """Its config dataclass (the `sync:` keys it takes)."""
    kind: str
    """Its kind (algorithms/rules/kinds.py `Kind`): what it means to the coordinator."""
    module: str
    """The `algorithms` module whose `Algorithm` class registers it (algorithms/policies/base.py imports it)."""
    codec: bool
    """Its collectives take `compression.codec` (the others refuse one, naming the key)."""
    cost_model: str | None
    """The runtime model's family for it (algorithms/rules/runtime_model.py `predict`): `synchronous`,
    `periodic`, `gossip` or `background`; None: not modelled, so `plan` and `auto` never weigh it (the
    server kinds: their traffic is Ray's, which neither the model nor the lab sees)."""
    server: bool = False
    """Run by a parameter server (actors/server/parameter_server.py): the `server:` section applies."""
    switchable: bool = False
    """An online trial (`sync.auto`) may switch to or from it mid-run: it holds BSP's replicated state at
    its commit points (the same parameters on every member after a step or a round), or, for streaming
    DiLoCo, whose fragments merge at different steps, at the one its members reach by synchronizing every
    fragment at once before they leave it (as at the end of a run); so a switch loses and repeats no
    sample (orchestrator/planner.py `SWITCHABLE`)."""
    weighed: tuple[Weighed, ...] = ()
    """The configurations `plan` and `auto` compare it in (none: never weighed; every row with a cost
    model has some, tests/unit/test_policy_table.py)."""


POLICIES: tuple[PolicyRow, ...] = (
    PolicyRow("bsp", BSPConfig, "synchronous", "algorithms.policies.allreduce", True, "synchronous", switchable=True,
              weighed=(Weighed("bsp"), Weighed("bsp hierarchical", {"hierarchical": True}, when="multi_node"))),
    PolicyRow("bytegrad", BytegradConfig, "synchronous", "algorithms.policies.allreduce", True, "synchronous",
              switchable=True,
              weighed=(Weighed("bytegrad uint8", codec="uint8"),
                       Weighed("bytegrad hierarchical uint8", {"hierarchical": True}, "uint8", "multi_node"))),
    PolicyRow("qadam", QAdamConfig, "synchronous", "algorithms.policies.qadam", True, "synchronous",
              weighed=(Weighed("qadam uint8", {"warmup_steps": 100}, "uint8", "adamw"),)),
    PolicyRow("local_sgd", LocalSGDConfig, "periodic", "algorithms.policies.periodic", True, "periodic", switchable=True,
              weighed=(Weighed("local_sgd h=8", {"h": 8}),)),
    PolicyRow("diloco", DiLoCoConfig, "periodic", "algorithms.policies.periodic", True, "periodic", switchable=True,
              weighed=(Weighed("diloco h=16", {"h": 16}),)),
    PolicyRow("streaming_diloco", StreamingDiLoCoConfig, "periodic", "algorithms.policies.periodic", True, "periodic",
              switchable=True, weighed=(Weighed("streaming_diloco h=16 f=4", {"h": 16, "fragments": 4, "overlap": 1}),)),
    PolicyRow("asp", ASPConfig, "server", "algorithms.policies.server_policies", False, None, server=True),
    PolicyRow("ssp", SSPConfig, "server", "algorithms.policies.server_policies", False, None, server=True),
    PolicyRow("quorum", QuorumConfig, "server", "algorithms.policies.server_policies", False, None, server=True),
    PolicyRow("elastic_bsp", ElasticBSPConfig, "server", "algorithms.policies.server_policies", False, None, server=True),
    PolicyRow("dpsgd", DPSGDConfig, "decentralized", "algorithms.policies.gossip", True, "gossip",
              weighed=(Weighed("dpsgd ring", {"topology": RING}), Weighed("dpsgd ring uint8", {"topology": RING}, "uint8"))),
    PolicyRow("dadam", DAdamConfig, "decentralized", "algorithms.policies.gossip", True, "gossip",
              weighed=(Weighed("dadam ring k=4", {"topology": RING, "k": 4}, when="adamw"),)),
    PolicyRow("choco", ChocoConfig, "decentralized", "algorithms.policies.gossip", True, "gossip",
              weighed=(Weighed("choco ring uint8", {"topology": RING}, "uint8", when="sgd"),)),
    PolicyRow("shadow", ShadowConfig, "background", "algorithms.policies.shadow", False, "background",
              weighed=(Weighed("shadow ma", {"method": "ma"}),)),
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
"""Policies run by a parameter server (actors/server/parameter_server.py): the `server:` section applies."""
NOT_WIRED: frozenset[str] = frozenset()
"""Policies whose settings the schema checks but that cannot run yet: a job naming one is refused
(exit 2) rather than started. None today."""
COMPRESSING_POLICIES = tuple(row.name for row in POLICIES if row.codec)
"""Policies whose collectives take a codec so far (the others refuse one, naming the key)."""
