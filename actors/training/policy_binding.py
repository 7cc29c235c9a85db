"""The synchronization policy a replica runs: the job's config under that policy, the policy's settings
(`Algorithm`) and its implementation bound to the model and optimizer (`AlgorithmImpl`).

A `PolicyBinding` never changes; a switch (the online trial of `sync.auto`, or a state saved under another
candidate) binds a new one, and the replica replaces its binding whole.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from algorithms.policies.base import Algorithm, AlgorithmImpl, get_algorithm
from algorithms.policies.sharded import ShardedAllReduce
from core.schema import JobConfig, parse


@dataclasses.dataclass(frozen=True)
class PolicyBinding:
    cfg: JobConfig
    """The job's config with this policy's `sync` and `compression`."""
    algorithm: Algorithm
    impl: AlgorithmImpl

    @classmethod
    def bind(cls, cfg: JobConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             on_gradients_ready: Callable[[], None], vote_extras: int = 0) -> PolicyBinding:
        """`cfg`'s policy on `model` and `optimizer`; `on_gradients_ready` as `AlgorithmImpl` says, and
        `vote_extras` step metrics in each vote."""
        kind = ShardedAllReduce if cfg.sharding.group_size > 1 else get_algorithm(cfg.sync.policy)  # bsp only (checked)
        algorithm = kind(cfg.sync, cfg.compression)
        impl = algorithm.bind(model, optimizer)
        impl.on_gradients_ready = on_gradients_ready
        impl.vote_extras = vote_extras
        return cls(cfg, algorithm, impl)

    @property
    def max_steps(self) -> int | None:
        """The steps a member trains before it stops (None for the server kinds, which count versions)."""
        return self.cfg.stop.max_steps if self.algorithm.counts_steps else None

    def config_with(self, sync: dict, compression: dict) -> JobConfig | None:
        """The job's config with `sync`/`compression`, or None where that is the policy running."""
        raw = self.cfg.to_dict()
        raw["sync"], raw["compression"] = sync, compression
        cfg = parse(JobConfig, raw)
        return None if (cfg.sync, cfg.compression) == (self.cfg.sync, self.cfg.compression) else cfg

    def saved(self) -> dict:
        """What a state records of the policy it was saved under."""
        return {"sync": dataclasses.asdict(self.cfg.sync), "compression": dataclasses.asdict(self.cfg.compression)}

    def trial_candidate(self, saved: dict | None) -> bool:
        """Whether a state saved under the policy `saved` was saved under one of this job's `sync.auto`
        candidates (its trial switches to that policy before loading it)."""
        trial = self.cfg.policy_trial
        return saved is not None and bool(trial) and \
            any(saved["sync"]["policy"] == c["sync"]["policy"] for c in trial["candidates"])
