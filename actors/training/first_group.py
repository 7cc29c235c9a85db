"""With replica groups (`sharding.group_size` > 1), what the members of an epoch's first replica group (rank
0's) do together that one member did alone without them: the sharded model's forward gathers its blocks over
its group, so they evaluate it together, and they gather the replica whole for a checkpoint and for the final
model, which rank 0 hands to the coordinator. The members of the other groups take no part (None).

A group failing in one of these is the group's failure (a CommError), as in a step; the workload's own
evaluation code may wrap it, and it is unwrapped here.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from actors.plan import Plan
from actors.training.checkpoint_writer import Checkpoint
from actors.training.parts import ReplicaParts
from actors.transport.comm import CommError

log = logging.getLogger(__name__)
T = TypeVar("T")


def evaluate(r: ReplicaParts, step: int) -> dict | None:
    """The workload's evaluation of the sharded model at `step`, by the first group together (None elsewhere)."""
    if not r.shards.in_first_group():
        return None
    try:
        return r.reporter.evaluation.whole(r.training.model, r.policy.impl, step)
    except Exception as err:  # noqa: BLE001 - raised again, by reraise
        r.policy.impl.reraise(err)


def checkpoint(r: ReplicaParts) -> Callable[[bool], Checkpoint]:
    """At a checkpoint's step: the first group gathers the replica whole (its model and AdamW state, as an
    unsharded run's), which rank 0 serializes on the step loop and hands to the coordinator as any
    checkpoint (the other members hand nothing: theirs is never called)."""
    if not r.shards.in_first_group():
        return r.committed.checkpoint
    whole = r.shards.gather()
    state = r.committed.state_bytes
    return lambda background: Checkpoint(lambda: state(whole), background=False)


def finish(r: ReplicaParts, plan: Plan) -> dict | None:
    """The end of the run: the first group gathers the replica whole (rank 0 keeps it: the final model) and
    evaluates it together; returns that evaluation (None outside the first group)."""
    if not r.shards.in_first_group():
        return None
    r.shards.finish(keep=plan.rank_of(r.slot) == 0)
    return evaluate(r, r.training.step)


def lost_to(work: Callable[[], T], what: str, failed: Callable[[CommError], None], lost: T) -> T:
    """`work()`, or `lost` where the group failed in it (`failed` tells the coordinator, as of a step's
    failure; the next step re-forms the group): only this work is lost."""
    try:
        return work()
    except CommError as err:
        log.warning("%s was lost: %s", what, str(err).splitlines()[0][:200])
        failed(err)
        return lost
