"""Connecting this process to Ray: an existing connection, a cluster's address, or a local Ray sized for
the job (which has no autoscaler, so a job asking for what the machine lacks is refused up front). Every
process of the orchestrator reaches its actors in the `orchestrator` namespace."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import ray

from core.schema import SERVER_POLICIES, ConfigError, JobConfig, OrchestratorError

NAMESPACE = "orchestrator"


def ensure_token_env() -> None:
    """Ray >= 2.60 enables token auth; a client in another process needs RAY_AUTH_MODE=token."""
    if "RAY_AUTH_MODE" in os.environ or not (Path.home() / ".ray" / "auth_token").exists():
        return
    try:  # sets the variable and refreshes Ray's cached config in this process
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    except ImportError:
        os.environ["RAY_AUTH_MODE"] = "token"


def connect(config: JobConfig | None = None, address: str | None = None, start_local: bool = True) -> bool:
    """Reuse an existing connection; else connect to `address`; else start a local Ray. True when this
    call started a local Ray (no autoscaler: what it has is all there will be)."""
    if ray.is_initialized():
        return False
    ensure_token_env()
    address = address or (config.ray.address if config else None) or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
        return False
    if not start_local:
        raise OrchestratorError("no Ray cluster to attach to: pass --address or set RAY_ADDRESS")
    workers = config.workers if config else None
    server = config.server.cpus if config and config.sync.policy in SERVER_POLICIES else 0.0  # one server actor
    wanted = math.ceil((workers.max or workers.count) * workers.cpus + server) if workers else 1
    num_cpus = max(config.ray.num_cpus or 0 if config else 0, wanted, 1)
    # "local": a new local Ray, never the address `ray start` left in Ray's temp dir (init() without an
    # address connects there, and fails for num_cpus, or lands on a cluster that is not this job's)
    ray.init(address="local", num_cpus=num_cpus, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False,
             logging_level=logging.ERROR)
    return True


def check_local_resources(config: JobConfig, total: dict) -> None:
    """A local Ray this job started has no autoscaler: a worker asking for a resource the machine lacks
    (`workers.gpus` with no GPU here) could never be placed, and the job would wait PAUSED for ever.
    ConfigError naming the key, what one worker asks and what the machine has."""
    w = config.workers
    for key, wanted, name in (("workers.gpus", w.gpus, "GPU"),):
        if wanted and total.get(name, 0) < wanted * w.min:
            raise ConfigError(f"{key}: each worker asks for {wanted:g} {name}s and workers.min = {w.min}, but the "
                              f"local Ray this job started has {total.get(name, 0):g} {name}s and no autoscaler "
                              f"to add any: run on a cluster that has them (ray.address, RAY_ADDRESS) or set {key}: 0")
