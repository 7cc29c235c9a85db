"""Connecting this process to Ray: an existing connection, a cluster's address, or a local Ray sized for
the job (which has no autoscaler, so a job asking for what the machine lacks is refused up front). Every
process of the orchestrator reaches its actors in the `orchestrator` namespace.

An address is tried first, bounded by `CONNECT_TIMEOUT_S` (`check_reachable`): `ray.init` retries an address
where nothing answers for a quarter of an hour (twenty tries of about 40 s, each logging "Failed to connect
to GCS ... within 5 seconds"), so a Ray that has shut down is named in one line (`RayUnreachable`)."""
from __future__ import annotations

import logging
import math
import os
import socket
import time
from pathlib import Path

import ray

from core.schema import SERVER_POLICIES, ConfigError, JobConfig, OrchestratorError

NAMESPACE = "orchestrator"
CONNECT_TIMEOUT_S = 10.0
"""How long a connect waits for anything to answer at a Ray address before giving up."""


class RayUnreachable(OrchestratorError):
    """Nothing answers at a Ray address (a cluster that is down, a local Ray whose process has ended)."""


class _LocalRay:
    """The GCS address of the local Ray `connect` started in this process (one at a time)."""

    address: str | None = None


def local_address() -> str | None:
    """The address of the local Ray that `connect` started in this process, while this process is still
    connected to it (None for a cluster's, or a connection made elsewhere)."""
    if _LocalRay.address is None or not ray.is_initialized():
        return None
    return _LocalRay.address if ray.get_runtime_context().gcs_address == _LocalRay.address else None


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """RayUnreachable (one line) unless a gRPC server, as Ray's GCS is, answers at `address` within
    `timeout_s`: `host:port`, `ray://host:port`, or `auto` (the cluster `ray start` last recorded here).
    A TCP connect alone proves little: a firewall may accept a connection and then say nothing, and a
    wrong port (the dashboard's) answers in HTTP/1. An HTTP/2 proxy that answers for any address passes
    (ray.init then waits as before). With TLS on (RAY_USE_TLS), whose handshake this does not speak, only
    the connect is tried."""
    target = _host_port(address)
    if target is None:  # a form Ray resolves itself; it gets no bound from here
        return
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection(target, timeout=timeout_s) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return
            conn.sendall(_HTTP2_PREFACE)
            reason = _first_frame_problem(conn, deadline)
    except OSError as err:
        reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err))
    if reason:
        raise RayUnreachable(f"no Ray at {address} (nothing answered within {timeout_s:g}s): {reason}; check the "
                             f"address, and that the cluster is up (ray status --address {target[0]}:{target[1]})")


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""What an HTTP/2 (gRPC) client sends first: the connection preface, then its (empty) SETTINGS frame."""


def _first_frame_problem(conn: socket.socket, deadline: float) -> str:
    """"" when the peer's first bytes are an HTTP/2 frame header of a SETTINGS frame (type 4), as every
    HTTP/2 server sends first; else what came instead."""
    head = b""
    while len(head) < 9:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = conn.recv(9 - len(head))  # socket.timeout (an OSError) past the deadline
        if not chunk:
            return "the connection was closed without an answer"
        head += chunk
    return "" if head[3] == 4 else "something answered, but not as Ray's GCS (a gRPC server) does"


def _host_port(address: str) -> tuple[str, int] | None:
    if address == "auto":
        try:  # where Ray itself looks: RAY_ADDRESS, then the file `ray start` writes
            from ray._private.services import canonicalize_bootstrap_address

            address = canonicalize_bootstrap_address(address) or ""
        except Exception:  # noqa: BLE001 - no cluster recorded: Ray says so itself, at once
            return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


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
        check_reachable(address)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
        return False
    if not start_local:
        raise OrchestratorError("no Ray cluster to attach to: pass --address or set RAY_ADDRESS")
    num_cpus = local_cpus(config)
    # "local": a new local Ray, never the address `ray start` left in Ray's temp dir (init() without an
    # address connects there, and fails for num_cpus, or lands on a cluster that is not this job's)
    ray.init(address="local", num_cpus=num_cpus, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False,
             logging_level=logging.ERROR)
    _LocalRay.address = ray.get_runtime_context().gcs_address
    return True


def local_cpus(config: JobConfig | None) -> int:
    """The logical CPUs of a local Ray started for `config`: room for `workers.max` workers and the
    `workers.spares` hot spares at `workers.cpus` each (a spare holds a worker's resources for the whole
    run, and a slot that takes one is replaced by a new spare), and the parameter server of a server
    policy; `ray.num_cpus` where larger."""
    if config is None:
        return 1
    w = config.workers
    server = config.server.cpus if config.sync.policy in SERVER_POLICIES else 0.0  # one server actor
    wanted = math.ceil(((w.max or w.count) + w.spares) * w.cpus + server)
    return max(config.ray.num_cpus or 0, wanted, 1)


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
