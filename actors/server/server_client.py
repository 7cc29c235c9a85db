"""A worker's way to the parameter server: `RayServerClient` over Ray, `LocalServerClient` in process.

Both are the `ServerClient` of algorithms/policies/server_policies.py. `RayServerClient` finds the server's actor
by name; a call that meets a restarting server answers "wait" (a pull) or is retried (a push: the
server recognises a retried push by its lease ids and applies it once). Parameters and gradients travel
as flat float32 arrays. `LocalServerClient` calls a `ServerHost` of this process (tests, `LocalJob`).
"""
from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import ray
import torch

from actors.server.dispenser_host import as_dispenser
from actors.server.server_host import ServerHost, as_tensor
from algorithms.policies.dispenser import NOTICES_IN_FLIGHT
from algorithms.policies.server_messages import Fence, Pull, Push, PushResult

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 30.0
"""Longest a worker waits for one answer of the server (beyond a pull's own wait)."""


class RayServerClient:
    """A worker's `ServerClient` (algorithms/policies/server_policies.py) over Ray, found by name."""

    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.namespace = name, namespace
        self._handle = None
        self._notices: deque = deque()
        """The applied notices sent and not yet answered (at most `NOTICES_IN_FLIGHT`)."""

    def _server(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    def pull(self, fence: Fence, wait_s: float) -> tuple[Pull, torch.Tensor | None]:
        try:
            pull, flat = ray.get(self._server().pull.remote(fence, wait_s), timeout=wait_s + CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - restarting or unreachable: the worker asks again
            log.warning("pull: the parameter server did not answer (%s); asking again", str(err).splitlines()[0][:200])
            self._handle = None
            time.sleep(wait_s)
            return Pull("wait"), None
        return pull, None if flat is None else as_tensor(flat)  # read-only: the worker copies it into its model

    def push(self, push: Push) -> PushResult:
        return self._send(push, None)[0]

    def push_pull(self, push: Push, wait_s: float) -> tuple[PushResult, Pull | None, torch.Tensor | None]:
        result, pull, flat = self._send(push, wait_s)
        return result, pull, None if flat is None else as_tensor(flat)

    def _send(self, push: Push, wait_s: float | None) -> tuple:
        """Sent until the server answers (a retry after a lost answer is recognised by its lease ids);
        with `wait_s`, the next pull comes back with the answer."""
        grad = push.grad.numpy()
        buffers = None if push.buffers is None else push.buffers.numpy()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        args = (push.fence, push.lease_ids, push.pulled_version, grad, push.loss)
        while True:
            try:
                if wait_s is None:
                    return (ray.get(self._server().push.remote(*args, buffers), timeout=CALL_TIMEOUT_S), None, None)
                return ray.get(self._server().push_pull.remote(*args, wait_s, buffers), timeout=wait_s + CALL_TIMEOUT_S)
            except Exception as err:
                if time.monotonic() > deadline:
                    raise
                log.warning("push: the parameter server did not answer (%s); sending it again", str(err).splitlines()[0][:200])
                self._handle = None
                time.sleep(0.5)


    # --- the lease dispenser (background kind)
    def lease_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple]:
        try:
            return ray.get(self._server().lease_block.remote(fence, count, size), timeout=CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - restarting or unreachable: the worker asks again
            log.warning("lease_block: the dispenser did not answer (%s); asking again", str(err).splitlines()[0][:200])
            self._handle = None
            return "wait", ()

    def applied(self, fence: Fence, keys: list[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> None:
        """Sent without waiting for its own answer, but only once the notices before it were answered
        (`NOTICES_IN_FLIGHT`): the dispenser counts a dead member's first `UNCERTAIN_AT_DEATH` open
        tickets as possibly applied, which holds only while no more are unacknowledged. A step takes far
        longer than a notice's round trip, so the wait is almost always for an answer already in. The
        `final` one is waited for."""
        while len(self._notices) >= NOTICES_IN_FLIGHT:
            try:
                ray.get(self._notices.popleft(), timeout=CALL_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - lost with a restarting server: its tickets were requeued there
                log.warning("an applied notice got no answer: %s", str(err).splitlines()[0][:200])
        ref = self._server().applied.remote(fence, list(keys), rounds, final, upto, finished)
        if final:
            ray.get(ref, timeout=CALL_TIMEOUT_S)
        else:
            self._notices.append(ref)

    def elastic(self, fence: Fence, x: torch.Tensor, alpha: float) -> torch.Tensor:
        answer = ray.get(self._server().elastic.remote(fence, x.detach().cpu().numpy(), alpha), timeout=CALL_TIMEOUT_S)
        return _elastic_difference(answer, x)


class LocalServerClient:
    """A `ServerClient` for a `ServerHost` in this process (tests)."""

    def __init__(self, host: ServerHost) -> None:
        self.host = host

    def pull(self, fence: Fence, wait_s: float) -> tuple[Pull, torch.Tensor | None]:
        pull, flat = self.host.pull(fence, wait_s)
        return pull, None if flat is None else torch.from_numpy(flat)

    def push(self, push: Push) -> PushResult:
        return self.host.push(push.fence, push.lease_ids, push.pulled_version, push.grad.numpy(), push.loss,
                              None if push.buffers is None else push.buffers.numpy())

    def push_pull(self, push: Push, wait_s: float) -> tuple[PushResult, Pull | None, torch.Tensor | None]:
        result, pull, flat = self.host.push_pull(push.fence, push.lease_ids, push.pulled_version, push.grad.numpy(),
                                                 push.loss, wait_s, None if push.buffers is None else push.buffers.numpy())
        return result, pull, None if flat is None else torch.from_numpy(flat)


    def lease_block(self, fence: Fence, count: int, size: int) -> tuple[str | None, tuple]:
        return as_dispenser(self.host).lease_block(fence, count, size)

    def applied(self, fence: Fence, keys: list[int], rounds: int, final: bool = False, upto: int = -1,
                finished: bool = False) -> None:
        as_dispenser(self.host).applied(fence, keys, rounds, final, upto, finished)

    def elastic(self, fence: Fence, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return _elastic_difference(as_dispenser(self.host).elastic(fence, x.detach().cpu().numpy(), alpha), x)


def _elastic_difference(answer: tuple[str | None, np.ndarray | None], x: torch.Tensor) -> torch.Tensor:
    """The host's answer to an EASGD exchange as a tensor like `x`; raises when it was refused."""
    refusal, d = answer
    if refusal is not None:
        raise RuntimeError(f"the central copy refused the exchange: {refusal}")
    return torch.from_numpy(np.array(d, dtype=np.float32)).to(device=x.device, dtype=x.dtype)
