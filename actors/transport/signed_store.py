"""The signed rendezvous store: a group's view of the coordinator's store, its values and counters signed
with the job's secret and checked on every read (`SignedStore`, `group_store`)."""
from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Sequence

import torch.distributed as dist

from core.comm_api import ForgedRendezvous, GroupSpec


class SignedStore(dist.Store):
    """A store whose values carry an HMAC-SHA256 under the job's secret, checked on every read.

    The coordinator's TCPStore takes any client that reaches its port, so anything on the network could
    otherwise rewrite the rendezvous (gloo addresses, the NCCL unique id, the listening addresses the
    abort shuts connections to, the shared-memory segment names) and inject or read gradients and state.
    The secret travels only over Ray (token-authenticated).

    The MAC covers the *full* key, the group's prefix included (`scope`: job, run, coordinator
    incarnation, membership epoch and the group's own suffix, such as `/bg`), and the value: a value
    signed for one group or epoch does not verify in another, so a signed value copied elsewhere in the
    store is refused like a forged one. Counters are signed too: `add` is a compare-and-set of a signed
    integer, so a counter changed from outside the job no longer verifies and is refused, never trusted.
    `delete_key` removes only a value this job signed. The store itself cannot stop an outsider who
    reaches its port from deleting a key: a member then waits for it until the group's timeout and the
    membership epoch re-forms (a stall, never a value accepted)."""

    def __init__(self, inner: dist.Store, secret: bytes, scope: str = "") -> None:
        """`inner`: the store as the group sees it (a `PrefixStore` of the group's name); `scope`: that
        prefix, which the MAC covers with each key."""
        super().__init__()
        self.inner, self._secret, self.scope = inner, secret, scope

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, (self.scope + key).encode() + b"\0" + value, hashlib.sha256).digest()

    def _signed(self, key: str, data: bytes) -> bytes:
        return self._mac(key, data) + data

    def _verified(self, key: str, raw: bytes) -> bytes:
        mac, data = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(mac, self._mac(key, data)):
            raise ForgedRendezvous(f"the rendezvous value for {key!r} is not signed with this job's key for group "
                                   f"{self.scope or '/'}: written by something outside the job, or copied from "
                                   f"another group or epoch; refused")
        return data

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        # torch's stub says str; c10d's Store.set takes bytes as well (a std::string either way)
        self.inner.set(key, self._signed(key, data))  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        return self._verified(key, bytes(self.inner.get(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        """A signed counter: read and verify the current value, then compare-and-set the signed sum (again
        if another member moved it meanwhile). A counter another client changed is refused."""
        while True:
            raw = bytes(self.inner.get(key)) if self.inner.check([key]) else b""
            current = int(self._verified(key, raw)) if raw else 0
            desired = self._signed(key, str(current + amount).encode())
            if bytes(self.inner.compare_set(key, raw, desired)) == desired:  # type: ignore[arg-type]  # bytes, as set
                return current + amount

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        """Delete a value this job signed (one that does not verify is refused, and left)."""
        if not self.inner.check([key]):
            return False
        self.get(key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def group_store(spec: GroupSpec, store: dist.Store) -> dist.Store:
    """The group's own view of the coordinator's store: its name's prefix, signed (over the full key) when
    the job has a key."""
    scope = spec.name + "/"
    prefix = dist.PrefixStore(scope, store)
    return SignedStore(prefix, spec.secret, scope) if spec.secret else prefix
