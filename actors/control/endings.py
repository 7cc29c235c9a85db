"""The end of a job: its final model, and each member's committed state when it failed.

Once every member of the plan finished at the same committed step, the job keeps one model: the
parameter server's (server kinds), rank 0's (every holder has the committed state; rank 0 of the
plan, unless it died after the others finished), or the average of the replicas (the kinds whose
replicas differ), evaluated once. A job that FAILED records each member's committed step and
checksum, straight from the worker.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from actors.control.book import MembershipBook
from actors.control.members import first_line
from actors.control.workers import WorkerGroup
from actors.runs import checkpoints
from algorithms.rules.kinds import FinalModel
from algorithms.rules.supervision import JobState, MemberState

S = MemberState
CALL_TIMEOUT_S = 60.0


async def wrap_up(kind: JobState, algorithm: Any, book: MembershipBook, group: WorkerGroup, server: Any, history: Any,
                  journal: Any, accept: Callable[[dict], None]) -> dict | None:
    """The end of a run whose members finished or stopped (`kind`): the server's last records into
    history (through `accept`), history closed at its committed step, the final model written (and
    kept as a checkpoint when the job did not finish, for --resume); returns the members' committed
    states when the job FAILED. `algorithm`: the policy's traits (its kind and final model)."""
    plan, members = book.plan, book.members
    if server is not None:  # its newest reports may still be on their way
        # closed first: a dispenser requeues what is still held (counted), and a snapshot being stored lands
        await server.close_at_end("the job ended")
        for record in await server.records_after(history.written_step):
            accept(record)
        await server.refresh_summary()
    history.close()
    journal.set_step(history.step([s for s in plan.members if members[s].holds_state])
                     if history.reporter.each_member_reports and plan else history.written_step)
    if plan is not None or server is not None:
        try:
            blob, _ = await final_model(algorithm.final_model, book, group, server, journal.event, journal.metrics)
            journal.checkpoints.write_model(blob)
            if kind != JobState.FINISHED:  # a stopped or failed job can be continued with --resume
                await journal.checkpoints.save(journal.step, blob, f"checkpoint at step {journal.step} on {kind.value.lower()}")
        except Exception as err:  # noqa: BLE001
            journal.event("info", f"could not fetch the final model: {first_line(err)}")
    return await committed_states(book, group) if kind == JobState.FAILED and plan else None


async def final_model(final: FinalModel, book: MembershipBook, group: WorkerGroup, server: Any,
                      note: Callable[..., Any], metrics: dict) -> tuple[bytes, str]:
    """(the model's bytes, where it came from); raises when nobody holds it. `final`: the kind's
    "average" or "rank0"; `metrics` is updated with the average's evaluation."""
    if final.averages_replicas:
        return await average_of_replicas(book, group, note, metrics), "the replicas"
    if server is not None:
        return await server.model_state(), "the server"
    plan, members = book.plan, book.members
    assert plan is not None  # the run had a plan
    ranked = [members[s] for s in plan.members] + list(members.values())
    rank0 = next((m for m in ranked if m.holds_state and m.state in (S.FINISHED, S.TRAINING)), None)
    if rank0 is None:
        raise RuntimeError("no live member holds the committed state")
    return await group.final_state(rank0.handle, timeout=CALL_TIMEOUT_S), rank0.slot


async def average_of_replicas(book: MembershipBook, group: WorkerGroup, note: Callable[..., Any],
                              metrics: dict) -> bytes:
    """The average over the members that finished (a member that finished first is no longer in the
    newest plan) and those of the plan still training, with the first one's other state; never a
    replica that never trained or loaded a state."""
    holders = [m for m in book.members.values() if m.holds_state and  # a training member was admitted by a plan
               (m.state == S.FINISHED or (m.state == S.TRAINING and book.plan is not None and m.slot in book.plan.members))]
    if not holders:
        raise RuntimeError("no member holds a trained replica")
    blobs = await asyncio.gather(*(group.final_state(m.handle, timeout=CALL_TIMEOUT_S) for m in holders))
    blob = await asyncio.to_thread(checkpoints.average_states, list(blobs))
    evaluated = await group.evaluate_state(holders[0].handle, blob, timeout=CALL_TIMEOUT_S) or {}
    metrics.update(evaluated)
    shown = ", ".join(f"{k} {v:.4f}" for k, v in evaluated.items())
    note("info", f"final model: the average of {len(holders)} replicas ({', '.join(m.slot for m in holders)})"
                 + (f": {shown}" if shown else ""), replicas=[m.slot for m in holders], metrics=evaluated)
    return blob


async def committed_states(book: MembershipBook, group: WorkerGroup) -> dict | None:
    """Each plan member's committed (step, checksum), as the worker says."""
    out = {}
    assert book.plan is not None  # asked during a run, under its plan
    for slot in book.plan.members:
        info = await group.status(book.members[slot].handle, timeout=3.0)
        out[slot] = {"step": info.step, "checksum": info.checksum} if info else {"error": "no answer"}
    return out or None
