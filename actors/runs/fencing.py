"""Incarnation claims on a store without conditional writes: which process of a run may write now.

When Ray restarts a coordinator (or a parameter server), the new process takes a new incarnation
number. After a partition the old process may still be running and still reach the store. It is a
zombie, and its writes must not win. S3 through pyarrow offers no conditional write (no
`If-None-Match`), so a read of the newest number followed by a plain write of `newest + 1` lets two
restarts take the same number. Instead each incarnation writes a key of its own,
`<prefix>/<number>-<token>`, that no other process ever writes, and the highest number listed under
`prefix` names the owner (`newest`).

A claim (`claim`) writes its key and then lists the prefix. If it sees another claim at its number
or above, it takes a number above those and tries again. On a store whose listing shows every write
that completed before the listing began (S3 since 2020, GCS, a local disk), two claims of one number
cannot both stand: whichever of the two wrote second lists the other's claim. Losing claims stay
under the prefix, so numbers are never reused.
"""
from __future__ import annotations

import json
import os
import random
import socket
import time
import uuid

from actors.runs.storage import Storage, StorageError

CLAIM_TRIES = 8
CLAIM_BACKOFF_S = 0.05
"""Two claims that saw each other both try again: a random wait of up to this (times the try) parts them."""


def claims(storage: Storage, prefix: str) -> list[tuple[int, str]]:
    """(number, token) of every claim under `prefix`."""
    found = []
    for key, _ in storage.list(prefix, recursive=False):
        number, _, token = key.rsplit("/", 1)[-1].partition("-")
        if number.isdigit() and token:
            found.append((int(number), token))
    return found


def newest(storage: Storage, prefix: str) -> int:
    """The highest incarnation claimed under `prefix`; -1 when there is none."""
    return max((number for number, _ in claims(storage, prefix)), default=-1)


def claim(storage: Storage, prefix: str, at_least: int = 0) -> int:
    """Claim the lowest number that is at least `at_least` and above every claim under `prefix`, and
    return it. Raises StorageError when rival claims keep colliding (CLAIM_TRIES times)."""
    token = uuid.uuid4().hex[:12]
    number = max(at_least, newest(storage, prefix) + 1)
    for attempt in range(1, CLAIM_TRIES + 1):
        body = {"incarnation": number, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        storage.write(f"{prefix}/{number:010d}-{token}", json.dumps(body).encode())
        rivals = [n for n, t in claims(storage, prefix) if n >= number and t != token]
        if not rivals:
            return number
        number = max(rivals) + 1
        time.sleep(random.uniform(0, CLAIM_BACKOFF_S * attempt))
    raise StorageError(f"storage: could not claim an incarnation under {storage.location(prefix)}: "
                       f"{CLAIM_TRIES} tries met rival claims")
