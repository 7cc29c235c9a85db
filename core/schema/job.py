"""The whole job (`JobConfig`, one YAML file): its sections, and the checks that span them."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from core.schema.errors import DAY_S, FieldError, within
from core.schema.faults import FaultsConfig
from core.schema.network import CommConfig, NetworkConfig, RayConfig
from core.schema.parser import SYSTEM_SET
from core.schema.policies import COMPRESSING_POLICIES, NOT_WIRED, SERVER_POLICIES, BSPConfig, QuorumConfig, SyncConfig
from core.schema.training import CheckpointConfig, CompressionConfig, ServerConfig, ShardingConfig, StopConfig, TrackingConfig
from core.schema.workload import Optimizer, OptimizerConfig, TorchOptimizerConfig, TrainingConfig, WorkersConfig, WorkloadConfig


@dataclass
class JobConfig:
    """The whole job, one YAML file."""

    name: str = ""
    seed: int = 0
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    optimizer: Optimizer = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sync: SyncConfig = field(default_factory=BSPConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
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
    checkpoints, server snapshots and `--resume` use it directly (actors/runs/storage.py)."""
    storage_options: dict = field(default_factory=dict)
    """Options of the storage taken from the environment, never written down: a mapping of an option
    name (`access_key`, `secret_key`, `session_token`, an fsspec filesystem's `account_key`, ...) to the
    name of an environment variable that holds its value on every node, e.g.
    `{access_key: MY_S3_KEY, secret_key: MY_S3_SECRET}`. Credentials written in the URI's query are
    moved here when the config is read (into `ORCHESTRATOR_STORAGE_<OPTION>` of the driver's
    environment, and the job's Ray runtime environment), so no copy of them is kept anywhere."""
    progress_every_s: float = 5.0
    """`run` prints a progress line at most this often (0: at every step it sees), in [0, 86400] s."""
    policy_choice: str = field(default="", metadata=SYSTEM_SET)
    """Set by `sync.policy: auto` when the job starts: the pick and its reason (the job's first event)."""
    policy_trial: dict = field(default_factory=dict, metadata=SYSTEM_SET)
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
        if isinstance(self.optimizer, TorchOptimizerConfig) and self.sync.policy in SERVER_POLICIES:
            raise FieldError("optimizer.name", f"policy {self.sync.policy!r} updates on its parameter server, in shards "
                                               f"cut anywhere in the flat parameters, which gives one buffer's update "
                                               f"for elementwise rules only: use sgd or adamw there, or a policy that "
                                               f"updates on the workers (bsp, local_sgd, dpsgd, ...)")
        if self.optimizer.clip_grad_norm is not None and self.sync.policy == "qadam":
            raise FieldError("optimizer.clip_grad_norm", "qadam sends a momentum built from each member's local gradient "
                                                         "before the update, where no clipping applies: use bsp (which "
                                                         "clips the reduced gradient) or leave it unset")
        if self.training.precision == "fp16-mixed" and self.sync.policy in SERVER_POLICIES:
            raise FieldError("training.precision", f"fp16-mixed scales each member's loss and skips an update whose "
                                                   f"gradient overflows, and {self.sync.policy!r} applies its updates on the "
                                                   f"parameter server: use bf16-mixed (no loss scale) there")
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
        if getattr(self.sync, "hierarchical", False) and self.group_backend == "nccl":
            raise FieldError("sync.hierarchical", "runs on gloo: NCCL's own rings and trees already follow the "
                                                  "nodes' topology (NVLink within a node); leave it false, or set "
                                                  "comm.backend: gloo")
        for option, variable in self.storage_options.items():
            if not isinstance(variable, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", variable):
                raise FieldError(f"storage_options.{option}", f"names the environment variable that holds the "
                                                              f"value (letters, digits, '_'), got {variable!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name or ""):
            raise FieldError("name", f"must be 1-64 characters of letters, digits, '_', '.', '-', got {self.name!r}")
        if self.eval_every < 0:
            raise FieldError("eval_every", f"must not be negative, got {self.eval_every}")
        within(self, "progress_every_s", 0.0, DAY_S, unit=" s")
        self._check_server_policy()
        self._check_sharding()
        if self.network.lab:
            self._check_network()
        slots = self.workers.max or self.workers.count
        for i, kill in enumerate(self.faults.kills):
            if not _is_slot(kill.slot, slots):
                raise FieldError(f"faults.kills[{i}].slot", f"{kill.slot!r} is not a slot of this job (w0..w{slots - 1})")
        for i, scale in enumerate(self.faults.scale):
            if not (self.workers.min <= scale.count <= (self.workers.max or self.workers.count)):
                raise FieldError(f"faults.scale[{i}].count", f"{scale.count} is outside [workers.min, workers.max] = "
                                                             f"[{self.workers.min}, {self.workers.max or self.workers.count}]")
        for i, delayed in enumerate(self.faults.delayed_pushes):
            if not _is_slot(delayed.slot, slots):
                raise FieldError(f"faults.delayed_pushes[{i}].slot", f"{delayed.slot!r} is not a slot of this job "
                                                                     f"(w0..w{slots - 1})")
            if self.sync.policy not in SERVER_POLICIES:
                raise FieldError(f"faults.delayed_pushes[{i}]", f"policy {self.sync.policy!r} does not push to a "
                                                                f"parameter server ({', '.join(sorted(SERVER_POLICIES))} do)")
        if self.faults.server and self.sync.policy not in SERVER_POLICIES:
            raise FieldError("faults.server", f"policy {self.sync.policy!r} runs no parameter server "
                                              f"({', '.join(sorted(SERVER_POLICIES))} do)")

    def _check_sharding(self) -> None:
        """Replica groups of more than one member run what has been built and tested for them; the rest is
        refused here, in one line, rather than failing on the workers."""
        if self.sharding.group_size == 1:
            return
        refused = {
            "sync.policy": (self.sync.policy != "bsp", f"{self.sync.policy!r} does not run over replica groups yet; bsp does"),
            "compression.codec": (self.compression.codec != "none", "sharded gradients travel uncompressed (set none)"),
            "optimizer.name": (not isinstance(self.optimizer, OptimizerConfig) or self.optimizer.name != "adamw",
                               "replica groups re-cut AdamW's state (set adamw)"),
            "optimizer.clip_grad_norm": (self.optimizer.clip_grad_norm is not None,
                                         "clipping a sharded gradient needs its norm over the shards: not built yet"),
            "training.precision": (self.training.precision != "fp32", "replica groups train in fp32 only (yet)"),
            "training.compile": (self.training.compile, "replica groups do not compile the model (yet)"),
            "training.activation_checkpointing": (self.training.activation_checkpointing,
                                                  "replica groups do not recompute activations (yet)"),
            "workers.gpus": (self.workers.gpus > 0, "replica groups run on CPU workers only (yet)"),
        }
        for name, (wrong, why) in refused.items():
            if wrong:
                raise FieldError(name, f"with sharding.group_size {self.sharding.group_size}: {why}")

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

    @property
    def group_backend(self) -> str:
        """The collective backend of the workers' groups: NCCL for GPU workers unless `comm.backend: gloo`."""
        return "nccl" if self.workers.gpus > 0 and self.comm.backend != "gloo" else "gloo"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _is_slot(slot: str, slots: int) -> bool:
    """`slot` names one of `w0`..`w<slots - 1>`, as the launcher names them (no leading zeros): read from
    the name, so the check costs the same whatever `workers.max` is."""
    match = re.fullmatch(r"w(0|[1-9]\d*)", slot)
    return match is not None and len(match.group(1)) <= len(str(slots)) and int(match.group(1)) < slots
