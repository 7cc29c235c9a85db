"""The moves between a replica's committed states that involve several of its parts: its bytes (the
training state with the data position, the newest record, the policy and the step metrics' names), a
holder's state loaded, provisional local steps rewound, a member behind skipped ahead.

`CommittedState` is what a membership epoch's entry (actors/training/entry.py `Member`) works on; it reaches
the parts through the replica (actors/training/parts.py `ReplicaParts`), whose policy binding a switch replaces.
"""
from __future__ import annotations

import io
from typing import Any

import torch

from actors.plan import Plan
from actors.training.checkpoint_writer import Checkpoint, host_copy
from actors.training.parts import ReplicaParts
from actors.training.state_transfer import broadcast_state
from actors.training.training_state import read_state


class CommittedState:
    """One replica's committed state, as the entry and the worker's calls move it."""

    def __init__(self, replica: ReplicaParts) -> None:
        self._r = replica

    @property
    def step(self) -> int:
        return self._r.training.step

    @property
    def holds_state(self) -> bool:
        return self._r.training.holds_state

    @property
    def impl(self) -> Any:
        return self._r.policy.impl

    @property
    def plan(self) -> Plan | None:
        return self._r.plan

    def committed_view(self) -> tuple[int, int]:
        r = self._r
        return r.training.committed_view(r.policy.impl)

    def committed_state(self) -> dict[str, Any]:
        """The committed state as a dict whose tensors are the live ones (what a transfer sends, chunk by
        chunk: actors/training/state_transfer.py)."""
        return self._r.training.to_state(self._r.policy.impl, self._carried())

    def load_received(self, state: dict[str, Any]) -> None:
        """Take a holder's newer committed state. If it is the very step (or round) this member
        attempted in the same epoch (a split vote: its result was lost here, but its share was in
        the all-reduce everyone else finished), this member's samples of it were applied."""
        r = self._r
        attempted, epoch = r.samples.take_pending(), r.trained_plan.membership_epoch if r.trained_plan else None
        self.load_state(state)
        record = r.reporter.newest()
        if attempted and epoch is not None and record is not None and record.get("membership_epoch") == epoch \
                and attempted[-1][0] == r.training.step:
            r.samples.write(attempted, epoch)

    def rewind(self) -> None:
        """Back to the committed state: provisional local steps (and their samples) are discarded."""
        r = self._r
        r.training.rewind(r.policy.impl)
        r.samples.forget()

    def skip_to(self, step: int) -> None:
        """Decentralized entry: a member behind the newest step skips ahead to it; the shares it would
        have trained in the steps it skips are counted as dropped."""
        r = self._r
        plan = r.trained_plan or r.newest_plan()
        rank = plan.rank_of(r.slot) or 0
        for cursor in r.training.skip_to(step, plan.global_batch):
            r.samples.drop(len(r.feed.ids_of(plan, cursor, rank)))
        r.feed.source.committed(r.training.mark_cursor)

    def _carried(self) -> dict[str, Any]:
        """What the replica's other parts carry in its state: the data position, the newest record, the
        policy, the step metrics' names."""
        r = self._r
        source = r.feed.source
        return {"data": {"position": source.state_dict(), "fingerprint": source.fingerprint()},
                "record": r.reporter.newest(), "policy": r.policy.saved(), "metric_names": list(r.metrics.names)}

    def state_bytes(self, whole: tuple[dict[str, Any], dict[str, Any]] | None = None) -> bytes:
        """The committed state: what a checkpoint holds, the final model (`whole`: its model's and optimizer's
        state gathered from a replica group)."""
        return self._r.training.to_bytes(self._r.policy.impl, self._carried(), whole)

    def final_bytes(self) -> bytes:
        """The committed state at the end of the run (`state_bytes`; with replica groups, the replica rank 0
        gathered whole at the end)."""
        shards = self._r.shards
        if shards is None:
            return self.state_bytes()
        if shards.whole is None:
            raise RuntimeError(f"{self._r.slot} holds no whole replica: with replica groups, rank 0 of the last plan "
                               f"gathers it at the end of the run")
        return self.state_bytes(shards.whole)

    def checkpoint(self, background: bool) -> Checkpoint:
        """A checkpoint of the committed state as it is now: serialized when it is written (`background`:
        from a host copy taken now, which training may go on past)."""
        if not background:
            return Checkpoint(self.state_bytes, background=False)
        state, copied = host_copy(self.committed_state())

        def serialize() -> bytes:
            if copied is not None:
                copied.synchronize()  # the GPU's copies into pinned memory are done
            buf = io.BytesIO()
            torch.save(state, buf)
            return buf.getvalue()
        return Checkpoint(serialize, background=True)

    def load_state_bytes(self, data: bytes) -> None:
        self.load_state(read_state(data))

    def load_state(self, state: dict[str, Any]) -> None:
        """Take a committed state (`read_state` of its bytes, or a transfer's)."""
        r = self._r
        self._check_data(state)
        if r.policy.trial_candidate(state.get("policy")):
            r.switch_policy(state["policy"]["sync"], state["policy"]["compression"])  # the policy it was saved under
        r.training.restore(state, r.policy.impl)
        self._load_carried(state)

    def _check_data(self, state: dict[str, Any]) -> None:
        source = self._r.feed.source
        if "data" in state and state["data"]["fingerprint"] != source.fingerprint():
            raise ValueError(f"the state's data ({state['data']['fingerprint']}) is not this job's "
                             f"({source.fingerprint()}): the training data changed since it was saved, so its "
                             f"data position would name other samples")

    def _load_carried(self, state: dict[str, Any]) -> None:
        """What the replica's other parts carry in a state (`_carried`), taken."""
        r = self._r
        if "data" in state:
            r.feed.source.load_state_dict(state["data"]["position"])
        r.samples.forget()
        r.reporter.keep(state.get("record"))
        if "metric_names" in state:  # the next on_membership sizes the vote for them
            r.metrics.load(tuple(state["metric_names"]))

    def enter_shards(self, comm: Any) -> int | None:
        """Entry `sharded`: the replica re-cut into this epoch's groups from the members' memory
        (actors/training/sharded_replica.py), this member then training its new shard; a member that stands
        at another step than the state they agreed on (a joiner, one whose step's vote was lost here but
        not everywhere) takes the position of the lowest-ranked member at that step. Returns that member's
        rank where this member took its position."""
        r = self._r
        shards = r.shards
        assert shards is not None  # the sharded policy runs only with replica groups
        state = shards.enter(comm, r.training.model, r.training.optimizer, r.training.step)
        r.train_shards(state.model, state.optimizer)
        mine = torch.tensor([r.training.step], dtype=torch.int64)
        steps = [torch.zeros_like(mine) for _ in range(comm.world_size)]
        comm.all_gather(steps, mine).wait()
        at = [int(s) for s in steps]
        if all(s == state.mark for s in at):
            return None
        src = min(rank for rank, s in enumerate(at) if s == state.mark)
        behind = at[comm.rank] != state.mark
        position = r.training.position(r.policy.impl, self._carried()) if comm.rank == src else None
        received = broadcast_state(comm, src, position, keep=not behind)
        if received is None:
            return None
        self._check_data(received)
        r.training.restore_position(received, r.policy.impl)
        self._load_carried(received)
        return src
