"""The job's detached coordinator as the driver reaches it through Ray: where it may run and with which
environment, launching it, finding it by name, asking an old one for its status, telling whether Ray is
restarting it, and waiting for it (or the job's other named actors) to be gone."""
from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from actors.runs import credentials, runfiles
from core.schema import TERMINAL_STATES, JobConfig
from orchestrator.connection import NAMESPACE

log = logging.getLogger(__name__)


def hand_over_credentials(config: JobConfig, run_id: str) -> None:
    """Put the storage credentials this process holds for the job (those taken out of its URI) where its
    coordinator and server read them at start-up: Ray's KV store (actors/runs/credentials.py)."""
    blob = credentials.bundle(config.storage_options)
    if blob is not None:
        runfiles.keep_secret(credentials.kv_key(config.name, run_id), blob)


def coordinator_resources(config: JobConfig) -> dict[str, float]:
    """Where the coordinator may run: the head node, or any node with `ray.coordinator_resources`."""
    return {str(k): float(v) for k, v in config.ray.coordinator_resources.items()} or {"node:__internal_head__": 0.001}


NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_")
"""The environment variables NCCL and torch's NCCL backend read: a driver's own settings reach its job's workers."""


def nccl_environment(config: JobConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's NCCL settings (`NCCL_*`, `TORCH_NCCL_*` in `environ`, this process's by default) for a job
    whose groups are NCCL's, else none. The coordinator is started with them in its runtime environment,
    which the workers it creates inherit (and merge with their own: actors/control/workers.py); a node's own
    environment still applies under them."""
    if config.group_backend != "nccl":
        return {}
    environ = dict(os.environ) if environ is None else environ
    return {name: value for name, value in environ.items() if name.startswith(NCCL_PREFIXES)}


def launch_coordinator(config: JobConfig, run_id: str, run_dir: str, resume_from: str | None, owner: str | None,
                       started_at: float) -> ActorHandle:
    """The job's coordinator, created detached under the job's name (Ray restarts it up to MAX_RESTARTS
    times). `owner`: the Ray job id of a driver that owns the job (it stops when that driver dies)."""
    from actors.control.coordinator import MAX_RESTARTS, CoordinatorActor

    hand_over_credentials(config, run_id)

    nccl = nccl_environment(config)
    handle = CoordinatorActor.options(
        name=config.name, namespace=NAMESPACE, lifetime="detached", resources=coordinator_resources(config),
        max_restarts=MAX_RESTARTS, **({"runtime_env": {"env_vars": nccl}} if nccl else {}),
    ).remote(config.to_dict(), run_id, run_dir, 0, (os.getcwd(),), resume_from, owner, started_at)
    if not isinstance(handle, ActorHandle):  # Ray's stubs type remote() as "a handle or the class"
        raise TypeError(f"creating the coordinator returned {type(handle).__name__}, not an actor handle")
    return handle


def remote_message(err: BaseException) -> str:
    """The original message of an exception raised inside an actor (without Ray's traceback)."""
    cause = getattr(err, "cause", None) or err
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__


def restarting(handle: ActorHandle) -> bool:
    """Whether Ray is restarting this actor (GCS actor table; no dashboard needed)."""
    try:
        from ray._private.state import state

        info = state.actor_table(handle._actor_id.hex())
        return bool(info) and info.get("State") in ("RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY", "ALIVE")
    except Exception as err:  # noqa: BLE001 - unknown: do not wait
        log.debug("could not read the actor table: %s", err)
        return False


def find_coordinator(name: str) -> ActorHandle | None:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


STATUS_TIMEOUT_S = 10.0
"""How long a start waits for the status of an existing coordinator under its job's name."""


class Prior(enum.Enum):
    """What a start under a job's name may do with an existing coordinator of that name."""

    ENDED = "ended"
    """It answered with a terminal state (FINISHED, FAILED, STOPPED): only its actor lingers; replaced."""
    GONE = "gone"
    """Its actor is dead and Ray is not restarting it: its name is being released; nothing to kill."""
    LIVE = "live"
    """Anything else (a live state, no answer in time, Ray restarting it): never killed by a start."""


@dataclass(frozen=True)
class PriorJob:
    verdict: Prior
    state: str
    """What it is, in words for a one-line refusal ("RUNNING at step 120", "not answering ...")."""


def prior_job(handle: ActorHandle, timeout: float | None = None) -> PriorJob:
    """Ask an existing coordinator what it is. Only a positive answer of a terminal state, or an actor
    that is dead for good, lets a start replace it: a slow coordinator, or one Ray is restarting, is a
    live job that a start must refuse to destroy. `timeout`: `STATUS_TIMEOUT_S` by default."""
    timeout = STATUS_TIMEOUT_S if timeout is None else timeout
    try:
        status = ray.get(handle.status.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return PriorJob(Prior.LIVE, f"not answering (its coordinator did not answer a status call within {timeout:g}s)")
    except ray.exceptions.RayActorError as err:
        if not isinstance(err, ray.exceptions.ActorUnavailableError) and not restarting(handle):
            return PriorJob(Prior.GONE, "gone")
        return PriorJob(Prior.LIVE, "being restarted by Ray")
    except Exception as err:  # noqa: BLE001 - any other failure to answer: not a positive end
        return PriorJob(Prior.LIVE, f"not answering ({remote_message(err)})")
    state = str(status.get("state"))
    if state in TERMINAL_STATES:
        return PriorJob(Prior.ENDED, state)
    return PriorJob(Prior.LIVE, f"{state} at step {status.get('step', 0)}")


def wait_actors_gone(names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.1)


def wait_gone(name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while find_coordinator(name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
