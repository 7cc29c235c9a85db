"""The signed rendezvous store: a group's view of the coordinator's store, its values signed with the
job's secret and checked on every read (`SignedStore`, `group_store`)."""
from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Sequence

import torch.distributed as dist

from core.comm_api import ForgedRendezvous, GroupSpec


class SignedStore(dist.Store):
    """A store whose values carry an HMAC-SHA256 over (key, value) under the job's secret, checked on
    every read: the coordinator's TCPStore takes any client that reaches its port, so anything on the
    network could otherwise rewrite the rendezvous (gloo addresses, the NCCL unique id, the listening
    addresses the abort shuts connections to) and inject or read gradients and state. The secret
    travels only over Ray (token-authenticated). Counters (`add`) are not signed: a forged one can
    only stall a formation, which then times out; no value read from one is trusted as an address."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        self.inner, self._secret = inner, secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        # torch's stub says str; c10d's Store.set takes bytes as well (a std::string either way)
        self.inner.set(key, self._mac(key, data) + data)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        mac, data = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(mac, self._mac(key, data)):
            raise ForgedRendezvous(f"the rendezvous value for {key!r} is not signed with this job's key: written by "
                                   f"something outside the job; refused")
        return data

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def group_store(spec: GroupSpec, store: dist.Store) -> dist.Store:
    """The group's own view of the coordinator's store: its name's prefix, signed when the job has a key."""
    prefix = dist.PrefixStore(spec.name + "/", store)
    return SignedStore(prefix, spec.secret) if spec.secret else prefix
