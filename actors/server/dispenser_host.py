"""The background kind's server (`shadow`): the lease dispenser and EASGD's central copy, on a `ServerHost`.

`DispenserHost` puts algorithms/policies/dispenser.py's `DispenserCore` behind the host's lock
(actors/server/server_host.py): it deals lease blocks, takes the members' applied notices and answers EASGD's
exchanges with the central copy. It applies no versions and reports no history (each member reports
its own); `model_state` is the central copy. A restarted dispenser starts from a fresh lease table (no
snapshots): the coordinator states it in an event.
"""
from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from actors.server.server_host import ServerHost, as_tensor, global_batch
from algorithms.policies.dispenser import DispenserCore
from algorithms.policies.server_messages import Fence

log = logging.getLogger(__name__)


class DispenserHost(ServerHost):
    """A `ServerHost` whose core is the lease dispenser and central copy (see the module's text)."""

    def _make_core(self) -> Any:
        return DispenserCore(list(self.model.parameters()), n_samples=self._samples_in(), seed=self.cfg.seed,
                             global_batch=global_batch(self.cfg))

    def _summary(self) -> dict:
        return {"pid": os.getpid(), "incarnation": self.core.incarnation, **self.core.summary()}

    def lease_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple]:
        with self.lock:
            refusal, tickets = self.core.deal_block(fence, count, size)
        return refusal, tickets

    def applied(self, fence: Fence, keys: Sequence[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> int:
        with self.lock:
            return self.core.applied(fence, list(keys), rounds, final, upto, finished)

    def elastic(self, fence: Fence, x: np.ndarray, alpha: float) -> tuple[str | None, np.ndarray | None]:
        with self.lock:
            refusal, d = self.core.elastic(fence, as_tensor(x), alpha)
        return refusal, None if d is None else d.numpy()

    def model_state(self) -> bytes:
        with self.lock:
            flat = self.core.central.clone()
        with self._model_lock:
            self._load_model(flat)
            buf = io.BytesIO()
            torch.save({"model": self.model.state_dict(), "step": 0}, buf)
        return buf.getvalue()

    def load_checkpoint(self, blob: bytes) -> int:
        raise RuntimeError("the lease dispenser of a background policy does not resume from a checkpoint")

    def _maybe_snapshot(self, updates: tuple) -> None:
        pass

    def _resume(self) -> None:
        self.core.incarnation = self._claim_incarnation(self.core.incarnation + 1)
        log.warning("lease dispenser restarted as incarnation %d: its lease table starts over", self.core.incarnation)
        self.reports.restarted(0, self.core.incarnation, None)


def as_dispenser(host: ServerHost) -> DispenserHost:
    """`host` as the dispenser that a lease block, an applied notice or an EASGD exchange is for."""
    if not isinstance(host, DispenserHost):
        raise AttributeError(f"a {type(host).__name__} deals no leases: only a background policy's dispenser does")
    return host
