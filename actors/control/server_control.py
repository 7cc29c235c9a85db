"""The coordinator's side of its job's parameter server (server policies: asp, ssp, quorum).

The coordinator creates the server before the workers (it must hold the initial parameters and the
first membership before anyone pulls), tells it every membership epoch before the plan goes out, takes
its history records and summary, states its restarts as events, closes it on a stop, takes the final
model and checkpoints from it, and kills it when the job ends. A restarted coordinator finds the live
server by name (it is detached) and catches up on the records it reported meanwhile. Kept out of
actors/control/coordinator.py so that the coordinator stays one state machine over members and plans.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.control.members import first_line, kill
from algorithms.rules.kinds import Kind
from algorithms.rules.zipline import BarrierPlanner
from core.schema import ElasticBSPConfig, JobConfig

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 60.0
SNAPSHOT_WAIT_S = 60.0
"""The longest a server's `close` waits for the snapshot it is storing."""


@dataclass
class ServerControl:
    handle: Any
    pid: int = 0
    summary: dict = field(default_factory=dict)
    """The server's newest counts (version, staleness histogram, refused pushes, leases), for `status`."""
    restarts: int = 0
    barriers: BarrierPlanner | None = None
    """elastic_bsp: ZipLine over each member's predicted iteration interval."""

    @classmethod
    async def start(cls, cfg: JobConfig, config: dict, run_id: str, run_dir: str) -> ServerControl:
        """Create the server and wait until it holds the initial state (Ray places it when a CPU is free)."""
        from actors.server.server_actor import start_server  # Ray's actor class: not in the coordinator's start

        handle = start_server(cfg, config, run_id, run_dir, cfg.ray.namespace)
        info = await asyncio.wrap_future(handle.ready.remote().future())
        return cls(handle, pid=info["pid"], summary={k: v for k, v in info.items() if k != "node"}, barriers=_barriers(cfg))

    @classmethod
    def attach(cls, cfg: JobConfig, run_id: str) -> ServerControl | None:
        from actors.server.server_actor import find_server

        handle = find_server(cfg.name, run_id, cfg.ray.namespace)
        return cls(handle, barriers=_barriers(cfg)) if handle is not None else None

    def set_members(self, epoch: int, members: Sequence[tuple[str, int]]) -> None:
        """Sent before the plan that names them; the server ignores an older epoch arriving late."""
        self.handle.set_members.remote(epoch, list(members))

    def restarted(self, epoch: int, members: Sequence[tuple[str, int]]) -> None:
        """Ray restarted the server: counted (status), and told the membership again (its snapshot may predate it)."""
        self.restarts += 1
        self.set_members(epoch, members)

    def place_barrier(self, index: int, members: Sequence[str], intervals: dict[str, list[float]]) -> None:
        """elastic_bsp: round `index` began; ZipLine places its barrier from the iteration times measured
        over the last round and the server gets it (it refuses one that came too late). Without an answer
        (the coordinator down or slow) the server keeps its fallback, a barrier after `r` iterations."""
        iterations = self.barriers.plan(tuple(members), intervals) if self.barriers is not None else None
        if iterations is not None:
            self.handle.set_schedule.remote(index, iterations)

    def close(self, reason: str) -> None:
        """Every pull answers `finished` from now on: the members stop."""
        self.handle.close.remote(reason, SNAPSHOT_WAIT_S)

    async def close_at_end(self, reason: str) -> None:
        """The job ended: the server closes and, before it is torn down, stores the snapshot it was storing
        (its `close` waits for that, `SNAPSHOT_WAIT_S` at most): a snapshot handed to its writer is not lost to the
        teardown. A server that does not answer in time is logged; the end goes on."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.handle.close.remote(reason, SNAPSHOT_WAIT_S).future()),
                                   SNAPSHOT_WAIT_S + CALL_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - the job ends all the same; its final model comes from model_state
            log.warning("the parameter server did not close cleanly: %s", first_line(err))

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

    async def take_report(self, records: tuple[dict, ...], summary: dict, written_step: int) -> tuple[dict, ...]:
        """A report of the server: its counts, and the records history takes (with those after
        `written_step` fetched again when the report skips some: reports lost in a restart)."""
        self.summary = summary
        if records and records[0]["step"] > written_step + 1:
            return await self.records_after(written_step)
        return records

    def kill(self) -> None:
        kill(self.handle)


def _barriers(cfg: JobConfig) -> BarrierPlanner | None:
    return BarrierPlanner(cfg.sync.r, cfg.sync.ewma) if isinstance(cfg.sync, ElasticBSPConfig) else None


def server_restarted(cfg: JobConfig, kind: Kind, server: ServerControl | None, book: Any, history: Any, journal: Any,
                     resumed: int, incarnation: int, snapshot: str | None) -> None:
    """Ray restarted the server from its snapshot at version `resumed`: the versions history holds after
    it are lost and redone (history records them again, with the new incarnation); the server is told
    the membership again, since its snapshot may predate it. The lease dispenser (background kind) has
    no versions: its lease table started over."""
    if kind.dispenses_leases:
        journal.event("server", f"lease dispenser restarted as incarnation {incarnation}: its lease table "
                                f"starts over (samples of the current data epoch may be dealt again)",
                      server_incarnation=incarnation)
    else:
        reason, detail = restart_event(history.written_step, resumed, incarnation, snapshot, cfg.server.snapshot_every)
        history.rewind(resumed)
        journal.set_step(resumed)
        journal.event("server", reason, **detail)
    if server is not None and book.plan is not None:
        server.restarted(book.epoch, book.server_membership())


def restart_event(history_step: int, resumed: int, incarnation: int, snapshot: str | None, every: int) -> tuple[str, dict]:
    """The event of a server restart: the versions after its snapshot that history holds were lost."""
    lost = max(0, history_step - resumed)
    unreported = [history_step + 1, resumed] if history_step < resumed else None
    source = f"its snapshot at version {resumed}" if snapshot else "its initial state (no snapshot yet)"
    reason = (f"parameter server restarted as incarnation {incarnation} from {source}: "
              + (f"versions {resumed + 1}..{history_step} lost ({lost}; server.snapshot_every = {every}), redone"
                 if lost else "no version lost")
              + (f"; versions {history_step + 1}..{resumed} are in the snapshot but were never reported: history "
                 f"has no record of them" if unreported else ""))
    return reason, {"resumed_version": resumed, "history_step": history_step, "versions_lost": lost,
                    "unreported": unreported, "server_incarnation": incarnation, "snapshot": snapshot,
                    "snapshot_every": every}
