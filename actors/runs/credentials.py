"""Storage credentials, held in the memory of the processes that use them and nowhere else.

A credential written in a storage URI (a query option that is not a known-safe setting, or the
`user:password@` part) is moved out of the config when the config is read (`storage.move_credentials`)
and held here, in the driver's memory, under the name the config's `storage_options` gives it
(`ORCHESTRATOR_STORAGE_<OPTION>`). When the job starts, the driver puts the job's credentials in Ray's
KV store, which only a client holding the cluster's token reaches (where the rendezvous key is kept
too), under the run's key; the coordinator and the parameter server read them at start-up into their
own memory (`receive`), and the coordinator deletes the key when it exits for good. They are never put
in a process environment (a child process would inherit it, and Ray's runtime-env agent logs the
variables it is given), an actor's arguments, the config, a log, an event or any file.

A `storage_options` entry that names a variable of the user's own (set on every node beforehand) is
read from the process's environment, as before.
"""
from __future__ import annotations

import json
import os

MOVED = "ORCHESTRATOR_STORAGE_"
"""The prefix of the names under which a credential moved out of a storage URI is held."""

_held: dict[str, str] = {}
"""This process's credentials: variable name -> value."""


def moved_name(option: str) -> str:
    """The name a credential moved out of the URI's option `option` is held under."""
    return MOVED + option.upper()


def hold(values: dict[str, str]) -> None:
    """Keep `values` ({name: value}) in this process's memory."""
    _held.update(values)


def value(name: str) -> str | None:
    """The credential held under `name`, else the environment's variable `name`, else None."""
    held = _held.get(name)
    return held if held is not None else os.environ.get(name)


def bundle(options: dict[str, str]) -> bytes | None:
    """The moved credentials that `options` (a config's `storage_options`) names and this process holds,
    as bytes for Ray's KV store; None when there are none (a user's own variables stay on the nodes)."""
    names = sorted(v for v in options.values() if v.startswith(MOVED) and v in _held)
    return json.dumps({n: _held[n] for n in names}).encode() if names else None


def receive(blob: bytes | None) -> None:
    """Hold the credentials a `bundle` carried (nothing for None)."""
    if blob:
        hold({str(k): str(v) for k, v in json.loads(blob).items()})


def kv_key(job: str, run_id: str) -> str:
    """Where a run's credentials are kept in Ray's KV store (as a secret: `WorkerGroup.keep_secret`)."""
    return f"{job}/{run_id}/storage-credentials"
