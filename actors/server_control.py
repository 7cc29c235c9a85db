"""The coordinator's side of its job's parameter server (server policies: asp, ssp, quorum).

The coordinator creates the server before the workers (it must hold the initial parameters and the
first membership before anyone pulls), tells it every membership epoch before the plan goes out, takes
its history records and summary, states its restarts as events, closes it on a stop, takes the final
model and checkpoints from it, and kills it when the job ends. A restarted coordinator finds the live
server by name (it is detached) and catches up on the records it reported meanwhile. Kept out of
actors/coordinator.py so that the coordinator stays one state machine over members and plans.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from actors.members import first_line, kill
from core.schema import JobConfig

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 60.0


@dataclass
class ServerControl:
    handle: Any
    pid: int = 0
    summary: dict = field(default_factory=dict)
    """The server's newest counts (version, staleness histogram, refused pushes, leases), for `status`."""
    restarts: int = 0

    @classmethod
    async def start(cls, cfg: JobConfig, config: dict, run_id: str, run_dir: str) -> "ServerControl":
        """Create the server and wait until it holds the initial state (Ray places it when a CPU is free)."""
        from actors.parameter_server import start_server  # noqa: PLC0415 - torch: not in the coordinator's start

        handle = start_server(cfg, config, run_id, run_dir, cfg.ray.namespace)
        info = await asyncio.wrap_future(handle.ready.remote().future())
        return cls(handle, pid=info["pid"], summary={k: v for k, v in info.items() if k != "node"})

    @classmethod
    def attach(cls, cfg: JobConfig, run_id: str) -> Optional["ServerControl"]:
        from actors.parameter_server import find_server  # noqa: PLC0415

        handle = find_server(cfg.name, run_id, cfg.ray.namespace)
        return cls(handle) if handle is not None else None

    def set_members(self, epoch: int, members: Sequence[tuple[str, int]]) -> None:
        """Sent before the plan that names them; the server ignores an older epoch arriving late."""
        self.handle.set_members.remote(epoch, list(members))

    def set_schedule(self, index: int, iterations: dict[str, int]) -> None:
        """elastic_bsp: ZipLine's barrier for round `index` (the server refuses it if it came too late)."""
        self.handle.set_schedule.remote(index, iterations)

    def close(self, reason: str) -> None:
        """Every pull answers `finished` from now on: the members stop."""
        self.handle.close.remote(reason)

    async def load_checkpoint(self, blob: bytes) -> int:
        """`--resume`: the new server takes the checkpoint's state; the version it resumes from."""
        return await asyncio.wait_for(asyncio.wrap_future(self.handle.load_checkpoint.remote(blob).future()), CALL_TIMEOUT_S)

    async def model_state(self) -> bytes:
        return await asyncio.wait_for(asyncio.wrap_future(self.handle.model_state.remote().future()), CALL_TIMEOUT_S)

    async def records_after(self, step: int) -> tuple[dict, ...]:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.handle.records_after.remote(step).future()), CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - a gap in history is declared, the job goes on
            log.warning("could not collect the server's records after version %d: %s", step, first_line(err))
            return ()

    async def refresh_summary(self) -> None:
        """Its counts now (the last report's may predate a close, which ends the open leases)."""
        try:
            self.summary = await asyncio.wait_for(asyncio.wrap_future(self.handle.summary.remote().future()), CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - status keeps the last reported counts
            log.warning("could not read the server's counts: %s", first_line(err))

    def kill(self) -> None:
        kill(self.handle)


def restart_event(history_step: int, resumed: int, incarnation: int, snapshot: Optional[str], every: int) -> tuple[str, dict]:
    """The event of a server restart: the versions after its snapshot that history holds were lost."""
    lost = max(0, history_step - resumed)
    source = f"its snapshot at version {resumed}" if snapshot else "its initial state (no snapshot yet)"
    reason = (f"parameter server restarted as incarnation {incarnation} from {source}: "
              + (f"versions {resumed + 1}..{history_step} lost ({lost}; server.snapshot_every = {every}), redone"
                 if lost else "no version lost"))
    return reason, {"resumed_version": resumed, "history_step": history_step, "versions_lost": lost,
                    "server_incarnation": incarnation, "snapshot": snapshot, "snapshot_every": every}
