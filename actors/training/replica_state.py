"""A replica's committed state: the newest commit point's mark, its bytes (what a joiner receives,
what a checkpoint holds, the final model) and checksum, and the ways to move to another one: load
a holder's state, rewind provisional local steps, skip ahead, switch policy.

`CommittedState` is a mixin of `Replica` (actors/training/replica.py); actors/training/entry.py reaches a replica
through its public half (`committed_view`, `committed_blob`, `load_blob`, `rewind`, `skip_to`).
Samples a member applied (`faults.record_samples`) are written here too, at each commit.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import logging

import numpy as np
import torch

from actors.plan import Plan
from actors.training.replica_base import ReplicaBase
from algorithms.policies.base import get_algorithm
from algorithms.rules.sampler import split_for_rank
from core.schema import JobConfig, parse

log = logging.getLogger(__name__)


def checksum(tensors) -> int:
    """A digest of the tensors' bytes (any dtype: bf16 has no numpy type, so bytes are viewed raw)."""
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


class CommittedState(ReplicaBase):
    """A `Replica`'s committed state: its mark, bytes and checksum, and the moves to another one."""

    def committed_view(self) -> tuple[int, int]:
        """(step, checksum) of the newest committed state."""
        params = self.impl.committed_parameters()
        return self._mark(), checksum(params if params is not None else self.model.parameters())

    def committed_blob(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self._state_bytes()), dtype=torch.uint8)

    def load_blob(self, blob: torch.Tensor) -> None:
        """Take a holder's newer committed state. If it is the very step (or round) this member
        attempted in the same epoch (a split vote: its result was lost here, but its share was in
        the all-reduce everyone else finished), this member's samples of it were applied."""
        attempted, epoch = self._pending_ids, self.trained_plan.membership_epoch if self.trained_plan else None
        self._load_state_bytes(blob.cpu().numpy().tobytes())
        record = self.kept[-1] if self.kept else None
        if attempted and epoch is not None and record is not None and record.get("membership_epoch") == epoch \
                and attempted[-1][0] == self.step:
            self._write_samples(attempted, epoch)

    def rewind(self) -> None:
        """Back to the committed state: provisional local steps (and their samples) are discarded."""
        self.impl.rewind()
        self.step, self.cursor = self._mark(), self.mark_cursor
        self._pending_ids = []

    def skip_to(self, step: int) -> None:
        """Decentralized entry: a member behind the newest step skips ahead to it; the shares it would
        have trained in the steps it skips are counted as dropped."""
        plan = self.trained_plan or self._plan_now()
        while self.step < step:
            batch = self.source.global_batch(self.cursor, plan.global_batch)
            self.dropped += len(split_for_rank(batch, plan.rank_of(self.slot) or 0, len(plan.members)))
            self.step += 1
            self.cursor += plan.global_batch
        self.mark_cursor = self.cursor
        self.source.committed(self.mark_cursor)

    def _switch_policy(self, sync: dict, compression: dict) -> None:
        """Run `sync`/`compression` from now on (a policy switched to mid-run, or the policy a state was
        saved under), from the newest commit point, where a switchable policy's replicas agree
        (orchestrator/planner.py `SWITCHABLE`): a periodic member that meets the switch between rounds
        rewinds its provisional local steps first. The model and the optimizer stay; the old policy's
        hooks go; the new one starts with fresh state of its own (its outer momentum, its residuals)."""
        cfg = self._policy_config(sync, compression)
        if cfg is None:
            return
        if self.impl.commit_mark is not None and self.step > self.impl.commit_mark:
            self.rewind()  # provisional local steps (met between rounds, after an abort): the new policy redoes them
        log.info("%s switches policy at step %d: %s -> %s", self.slot, self.step, self.cfg.sync.policy, cfg.sync.policy)
        self.impl.detach()
        self.cfg = cfg
        self.algorithm = get_algorithm(cfg.sync.policy)(cfg.sync, cfg.compression)
        self.impl = self.algorithm.bind(self.model, self.optimizer)
        self.impl.on_gradients_ready = self._gradients_ready
        self.impl.vote_extras = len(self.metric_names)
        self.impl.start_at(self.step)  # e.g. a periodic policy's first committed state: this step's, not step 0's
        self.max_steps = cfg.stop.max_steps if self.algorithm.counts_steps else None

    def _policy_config(self, sync: dict, compression: dict) -> JobConfig | None:
        """The job's config with `sync`/`compression`, or None where that is the policy running."""
        raw = self.cfg.to_dict()
        raw["sync"], raw["compression"] = sync, compression
        cfg = parse(JobConfig, raw)
        return None if (cfg.sync, cfg.compression) == (self.cfg.sync, self.cfg.compression) else cfg

    def _policy_state(self) -> dict:
        return {"sync": dataclasses.asdict(self.cfg.sync), "compression": dataclasses.asdict(self.cfg.compression)}

    def _count_dropped(self, trained: Plan | None, plan: Plan) -> None:
        """The survivors keep their local steps since the last commit: the shares that departed
        members trained in those steps died with their replicas (counted, and recorded with
        `faults.record_samples`)."""
        if trained is None:
            return
        departed = [s for s in trained.members if s not in plan.members and s not in self._dropped_slots]
        self._dropped_slots.update(departed)
        mark = self._mark()
        for k in range(self.step - mark):
            batch = self.source.global_batch(self.mark_cursor + k * trained.global_batch, trained.global_batch)
            shares = [split_for_rank(batch, trained.members.index(s), len(trained.members)) for s in departed]
            lost = np.concatenate(shares) if shares else np.empty(0, dtype=np.int64)
            self.dropped += len(lost)
            if self._samples is not None and plan.rank_of(self.slot) == 0 and len(lost):
                self._samples.write(f"dropped {plan.membership_epoch} {mark + k + 1} {' '.join(map(str, lost.tolist()))}\n")
                self._samples.flush()

    def _write_samples(self, steps: list[tuple[int, np.ndarray]], epoch: int) -> None:
        """`faults.record_samples`: `step membership_epoch ids...` for each step this member applied."""
        if self._samples is None or not steps:
            return
        for step, ids in steps:
            self._samples.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")
        self._samples.flush()

    def _state_bytes(self) -> bytes:
        """The committed state: what a joiner receives, what a checkpoint holds, the final model."""
        model = self.model.state_dict()
        committed = self.impl.committed_parameters()
        if committed is not None:
            model.update({name: t.detach().clone() for name, t in zip(self.param_names, committed)})
        buf = io.BytesIO()
        torch.save({"model": model, "optimizer": self.optimizer.state_dict(), "step": self._mark(),
                    "cursor": self.mark_cursor, "algorithm": self.impl.state_dict(),
                    "data": {"position": self.source.state_dict(), "fingerprint": self.source.fingerprint()},
                    "record": self.kept[-1] if self.kept else None,
                    "rng": {"torch": torch.get_rng_state()}, "policy": self._policy_state(),
                    "metric_names": list(self.metric_names)}, buf)
        return buf.getvalue()

    def _load_state_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if "data" in state and state["data"]["fingerprint"] != self.source.fingerprint():
            raise ValueError(f"the state's data ({state['data']['fingerprint']}) is not this job's "
                             f"({self.source.fingerprint()}): the training data changed since it was saved, so its "
                             f"data position would name other samples")
        saved = state.get("policy")
        if saved is not None and self.cfg.policy_trial and \
                any(saved["sync"]["policy"] == c["sync"]["policy"] for c in self.cfg.policy_trial["candidates"]):
            self._switch_policy(saved["sync"], saved["compression"])  # a trial's state: the policy it was saved under
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.impl.load_state_dict(state["algorithm"])
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.holds_state = True
        self.mark_cursor = self.cursor
        if "data" in state:
            self.source.load_state_dict(state["data"]["position"])
        self._pending_ids = []
        record = state.get("record")
        if record is not None and (not self.kept or self.kept[-1]["step"] < record["step"]):
            self.kept.append(record)
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
        if "metric_names" in state:  # the next on_membership sizes the vote for them
            self._set_metric_names(tuple(state["metric_names"]))

