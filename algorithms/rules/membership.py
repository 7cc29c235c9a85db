"""Membership decisions, pure: who leaves on scale-down, new slot ids, batch and LR per world size,
where a slot's worker comes from (a hot spare or a new actor), and what a worker Ray cannot place lacks.

The coordinator calls these with plain values and acts on the answer; they never touch Ray,
so every rule is unit-tested in milliseconds.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from algorithms.rules.kinds import Kind


@dataclass(frozen=True)
class MemberView:
    slot: str
    compute_s: float
    """EWMA of forward + backward time per step (0 when not yet measured)."""


def slot_index(slot: str) -> int:
    return int(slot[1:])


def choose_leavers(members: list[MemberView], count: int, policy: str) -> list[str]:
    """`newest`: the highest slot ids; `slowest`: the largest compute time (ties: newest)."""
    if count <= 0:
        return []
    if policy == "slowest":
        ranked = sorted(members, key=lambda m: (m.compute_s, slot_index(m.slot)), reverse=True)
    else:
        ranked = sorted(members, key=lambda m: slot_index(m.slot), reverse=True)
    return [m.slot for m in ranked[:count]]


def free_slots(max_workers: int, taken: set[str], retired: set[str], count: int) -> list[str]:
    """Slots are positions w0..w{max-1}: the lowest ones neither taken nor retired.

    A replacement takes the dead worker's slot back, so a slot's failures add up to its budget.
    """
    free = [f"w{i}" for i in range(max_workers) if f"w{i}" not in taken and f"w{i}" not in retired]
    return free[:max(count, 0)]


class JoinerSource(enum.Enum):
    """Where a slot that needs a worker (a joiner, a replacement) gets it."""

    SPARE = "a ready hot spare"
    NEXT_SPARE = "the next hot spare to be ready"
    NEW_ACTOR = "a new worker actor"


def joiner_source(ready_spares: int, starting_spares: int, waiting: int) -> JoinerSource:
    """A ready spare first. Else, while more spares are starting (placed, or not yet known to lack room)
    than slots already wait for one, the next spare to be ready: it holds its resources already and its
    start is under way, where a new actor would ask the cluster for room it may not have (a local Ray is
    sized for `workers.max` plus the spares) and take the cores the spare's start needs. Else a new actor
    (which still gives way to a spare that becomes ready before it does: the launcher's race)."""
    if ready_spares > 0:
        return JoinerSource.SPARE
    if starting_spares > waiting:
        return JoinerSource.NEXT_SPARE
    return JoinerSource.NEW_ACTOR


def placement_shortfall(cpus: float, gpus: float, free: Mapping[str, float]) -> str | None:
    """What one worker asks that the cluster has not free, in words ("needs 1 CPUs, the cluster has 0 CPUs
    free"); None when it fits (an actor without a process then is being placed, not stuck)."""
    if free.get("CPU", 0.0) >= cpus and (not gpus or free.get("GPU", 0.0) >= gpus):
        return None
    return (f"needs {cpus:g} CPUs" + (f" and {gpus:g} GPUs" if gpus else "")
            + f", the cluster has {free.get('CPU', 0.0):g} CPUs" + (f" and {free.get('GPU', 0.0):g} GPUs" if gpus else "")
            + " free")


def batch_for(world: int, per_worker: int, initial_world: int, mode: str, lr_rule: str = "linear") -> tuple[int, float]:
    """(global batch, LR scale) at this world size.

    keep_global: the global batch of the initial world; each worker's share adjusts, LR unchanged.
    keep_worker: each worker keeps its batch; the LR follows the global batch by `lr_rule` (the
    optimizer's `resize_rule`): `linear` in the world size (SGD's), `sqrt` (Adam's), or `none`.
    """
    if mode == "keep_worker":
        ratio = world / initial_world
        return per_worker * world, {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[lr_rule]
    return per_worker * initial_world, 1.0


def share_refusal(world: int, per_worker: int, initial_world: int, mode: str, batch_norm: bool = False) -> str | None:
    """Why `world` members cannot train the job's global batch, in one line (None: they can). Under
    `keep_global` the global batch stays that of the initial world, so past it a member's share would be
    empty (it has nothing to train, and a mean over no samples is NaN); with a BatchNorm model, a share of
    one sample has no batch statistics (BatchNorm1d raises on it at the first step, in every member, at
    every try). Under `keep_worker` each share is `workload.batch_size` whatever the world."""
    global_batch, _ = batch_for(world, per_worker, initial_world, mode)
    if mode == "keep_worker" or world < 1:
        return None
    least = 2 if batch_norm else 1
    if global_batch // world >= least:
        return None
    allowed = global_batch // least
    what = ("an empty share" if global_batch < world else
            "a share of one sample, and the model has BatchNorm layers (one sample has no batch statistics)")
    return (f"{world} workers would leave a worker {what}: the global batch is {global_batch} samples "
            f"(workload.batch_size {per_worker} x workers.count {initial_world}, workers.batch_mode: keep_global), "
            f"which allows at most {allowed} workers; raise workload.batch_size or use workers.batch_mode: keep_worker")


def server_members(kind: Kind, members: tuple[tuple[str, int], ...],
                   leaving: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
    """The (slot, worker incarnation) pairs the parameter server (or the lease dispenser) admits with
    a plan of `members`, while `leaving` (live members the plan leaves out) have not left yet.

    The background kind's dispenser keeps a leaver until it leaves: the membership reaches the
    dispenser before the plan reaches the leaver, which trains on its block until then; its notices
    of that time are good (its replica is live, and rounds may carry its updates), and its final
    notice releases it (applied up to its last ticket, the rest requeued). Released at once, as a
    death, its notices were refused and its tickets requeued while it still applied them. The server
    kinds admit the plan's members only: a leaver's unpushed tickets go back at once, and a push of
    one that arrives later is refused, its samples dealt again (never applied twice)."""
    if not kind.dispenses_leases:
        return members
    admitted = {slot for slot, _ in members}
    return members + tuple(pair for pair in leaving if pair[0] not in admitted)


def joiners_start_stateless(kind: Kind, committed_step: int) -> bool:
    """Whether joiners admitted now hold no state of their own until they receive one from a member
    (they count as holders only then: alone, they would start over from their initial model)."""
    return kind.members_hold_state and committed_step > 0  # a server kind's members hold none: the server does
