"""The job's sections around its policy: the parameter server, compression, checkpoints, tracking
and when to stop."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from core.schema.errors import FieldError, at_least, nearest, within


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
        at_least(self, "shards", 1)
        at_least(self, "snapshot_every", 1)
        if self.cpus < 0:
            raise FieldError("cpus", f"must not be negative, got {self.cpus}")


CODECS = ("none", "fp16", "bf16", "uint8", "onebit")


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
    background: bool | None = None
    """Rank 0 copies the state to the host at the checkpoint's step and serializes it in a thread while
    training goes on (actors/training/checkpoint_writer.py). Unset: for a model on a GPU; `true` on the
    CPU too (a second copy of the state while it is written); `false`: on the step loop."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise FieldError("every_steps", f"must be at least 1, got {self.every_steps}")
        if self.keep < 1:
            raise FieldError("keep", f"must be at least 1, got {self.keep}")


@dataclass
class ShardingConfig:
    """Replica groups: the members form groups of `group_size`, and inside a group the model, its
    gradients and the optimizer's state are cut `group_size` ways (torch's FSDP); across groups the
    policy keeps the shards equal (actors/training/sharding.py)."""

    group_size: int = 1
    """Members per replica group; 1: every member holds the whole replica. An epoch whose world it does not
    divide uses the smallest divisor of the world above it (4 members in groups of 2 that lose one go on as
    one group of 3)."""
    mirror: bool = True
    """Each member also keeps a copy of its neighbour's shard in host memory, kept current every step
    (one more gradient shard sent a step), so that a group survives the death of one member without
    storage."""

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise FieldError("group_size", f"must be at least 1, got {self.group_size}")


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

    def unknown_in(self, metrics: Mapping[str, float]) -> str | None:
        """One line when an evaluation's `metrics` lack this target's metric (a typo: the target would never
        be reached, and the job would run on to its other limits); None when they have it."""
        if self.metric in metrics:
            return None
        hint = nearest(self.metric, metrics)
        return (f"stop.target.metric {self.metric!r} is not among the metrics evaluate returned "
                f"({', '.join(sorted(metrics))})" + (f"; did you mean {hint!r}?" if hint else ""))


@dataclass
class StopConfig:
    max_steps: int | None = None
    target: TargetConfig | None = None
    time_s: float | None = None
    """Stop after this many seconds of training, in (0, 31622400] (366 days: longer than any run; leave it
    out for no time limit)."""

    def __post_init__(self) -> None:
        if self.max_steps is None and self.target is None and self.time_s is None:
            raise FieldError("max_steps", "set at least one of stop.max_steps, stop.target, stop.time_s")
        if self.max_steps is not None and self.max_steps < 1:
            raise FieldError("max_steps", f"must be at least 1, got {self.max_steps}")
        if self.time_s is not None:
            within(self, "time_s", 0.0, 366 * 86400.0, low_open=True, unit=" s")
