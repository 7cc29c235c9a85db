"""The config schema: every config dataclass, plus the status, result and event types.

Everything a user writes in YAML is parsed into the dataclasses here and validated before anything
starts (no Ray, no process group, no torch). Everything the job reports back (`JobStatus`, `JobResult`,
`Event`) is defined here too, so the driver, the actors and the CLI share one vocabulary. Errors are
`ConfigError`s whose single line names the key, the bad value and what is allowed.

One idea per module; this package re-exports every name, so `from core.schema import JobConfig, parse`
is how the rest of the repository reads it:

- `errors`: the config error classes (`ConfigError`, `FieldError`, ...) and the field checks.
- `workload`: workers, workload, data loader, optimizer.
- `policies`: each sync policy's knobs and the one policy table, `POLICIES`, with the lists derived from it.
- `training`: parameter server, compression, checkpoints, tracking, stop.
- `faults`: the injected faults.
- `network`: the lab's (or a cluster's) network, the communicator's settings, Ray.
- `job`: `JobConfig`, the whole job, and the checks that span its sections.
- `parser`: `parse`, from plain YAML data to validated dataclasses.
- `status`: what a job reports back (`JobStatus`, `JobResult`, `Event`, `MemberStatus`).
"""
from __future__ import annotations

from core.schema.errors import ConfigError, FieldError, NameTaken, OrchestratorError, WorkloadRefused, nearest
from core.schema.faults import CoordinatorFault, DelayedPush, FaultsConfig, JitterSpec, KillFault, ScaleFault, StragglerFault
from core.schema.job import JobConfig
from core.schema.network import CommConfig, LinkConfig, NetworkConfig, PairLink, RayConfig
from core.schema.parser import parse, system_keys, user_keys
from core.schema.policies import (
    COMPRESSING_POLICIES,
    NOT_WIRED,
    POLICIES,
    POLICY_TABLE,
    SERVER_POLICIES,
    STATIC_TOPOLOGIES,
    SYNC_POLICIES,
    TOPOLOGY_KINDS,
    ASPConfig,
    AutoConfig,
    BSPConfig,
    BytegradConfig,
    ChocoConfig,
    DAdamConfig,
    DiLoCoConfig,
    DPSGDConfig,
    ElasticBSPConfig,
    LocalSGDConfig,
    PolicyRow,
    QAdamConfig,
    QuorumConfig,
    ShadowConfig,
    SSPConfig,
    StreamingDiLoCoConfig,
    SyncConfig,
    TopologyConfig,
    TrialConfig,
    Weighed,
)
from core.schema.status import TERMINAL_STATES, Event, JobResult, JobState, JobStatus, MemberStatus
from core.schema.training import (
    CODECS,
    CheckpointConfig,
    CompressionConfig,
    ServerConfig,
    ShardingConfig,
    StopConfig,
    TargetConfig,
    TrackingConfig,
)
from core.schema.workload import (
    BUILT_IN_OPTIMIZERS,
    PRECISIONS,
    LearningRate,
    LoaderConfig,
    Optimizer,
    OptimizerConfig,
    TorchOptimizerConfig,
    TrainingConfig,
    WorkersConfig,
    WorkloadConfig,
)

__all__ = [
    "BUILT_IN_OPTIMIZERS", "LearningRate", "Optimizer", "PRECISIONS", "TorchOptimizerConfig", "TrainingConfig",
    "ASPConfig", "AutoConfig", "BSPConfig", "BytegradConfig", "CODECS", "COMPRESSING_POLICIES", "CheckpointConfig",
    "ChocoConfig", "CommConfig", "CompressionConfig", "ConfigError", "CoordinatorFault", "DAdamConfig", "DPSGDConfig",
    "DelayedPush", "DiLoCoConfig", "ElasticBSPConfig", "Event", "FaultsConfig", "FieldError", "JitterSpec", "JobConfig",
    "JobResult", "JobState", "JobStatus", "KillFault", "LinkConfig", "LoaderConfig", "LocalSGDConfig", "MemberStatus", "NameTaken",
    "NOT_WIRED", "NetworkConfig", "OptimizerConfig", "OrchestratorError", "POLICIES", "POLICY_TABLE", "PairLink",
    "PolicyRow", "Weighed", "QAdamConfig", "QuorumConfig", "RayConfig", "SERVER_POLICIES", "SSPConfig", "STATIC_TOPOLOGIES",
    "SYNC_POLICIES", "ScaleFault", "ServerConfig", "ShadowConfig", "ShardingConfig", "StopConfig", "StragglerFault",
    "StreamingDiLoCoConfig", "SyncConfig", "TERMINAL_STATES", "TOPOLOGY_KINDS", "TargetConfig", "TopologyConfig",
    "TrackingConfig", "TrialConfig", "WorkersConfig", "WorkloadConfig", "WorkloadRefused", "nearest", "parse", "system_keys",
    "user_keys",
]
