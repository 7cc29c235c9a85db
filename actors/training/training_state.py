"""A replica's training state: the model, the optimizer, the step, the data cursor and the newest
commit point's mark; its bytes (what a joiner receives, what a checkpoint holds, the final model)
and checksum; and the moves to another committed state (commit, rewind, skip ahead, restore).

`TrainingState` is the only writer of these fields. The policy running decides where the commit
point is (a periodic policy's local steps stay provisional until its round): every method that
needs it is passed the policy's implementation, which the replica's `PolicyBinding` holds.
"""
from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from typing import Any

import torch

from algorithms.policies.base import AlgorithmImpl
from algorithms.policies.precision import GuardedOptimizer, Precision


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """A digest of the tensors' bytes (any dtype: bf16 has no numpy type, so bytes are viewed raw)."""
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


def read_state(data: bytes) -> dict[str, Any]:
    """A state's bytes, parsed (tensors and plain values only: `weights_only`)."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


class TrainingState:
    """The model and optimizer, where training stands (`step`, `cursor`) and the newest commit point
    (`mark(impl)`, `mark_cursor`)."""

    def __init__(self, model: torch.nn.Module, optimizer: GuardedOptimizer, precision: Precision) -> None:
        self.model = model
        self.optimizer = optimizer
        """The configured optimizer behind the loss scale and the clipping (algorithms/policies/precision.py)."""
        self.precision = precision
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.step = 0
        self.cursor = 0
        """The data cursor: where the next global batch starts in the sampler's order."""
        self.mark_cursor = 0
        """The data cursor at the newest commit point."""
        self.holds_state = False
        """It trained a step or loaded a state (entry `average`: a member that never did receives one)."""

    def mark(self, impl: AlgorithmImpl) -> int:
        """The step of the newest committed state (the current step, unless periodic local steps are
        provisional)."""
        mark = impl.commit_mark
        return self.step if mark is None else mark

    def provisional(self, impl: AlgorithmImpl) -> bool:
        """Whether local steps past the newest commit point are held (a periodic policy between rounds)."""
        return impl.commit_mark is not None and self.step > impl.commit_mark

    def provisional_cursors(self, impl: AlgorithmImpl, global_batch: int) -> list[int]:
        """The data cursors of the local steps past the newest commit point (trained `global_batch` apart)."""
        return [self.mark_cursor + k * global_batch for k in range(self.step - self.mark(impl))]

    def advance(self, global_batch: int) -> None:
        """A step was applied: training moves on by one global batch."""
        self.step += 1
        self.cursor += global_batch
        self.holds_state = True

    def commit(self, impl: AlgorithmImpl) -> int:
        """The current step is the newest committed state; returns its data cursor."""
        impl.commit(self.step)
        self.mark_cursor = self.cursor
        return self.mark_cursor

    def rewind(self, impl: AlgorithmImpl) -> None:
        """Back to the committed state: provisional local steps are discarded."""
        impl.rewind()
        self.step, self.cursor = self.mark(impl), self.mark_cursor

    def skip_to(self, step: int, global_batch: int) -> list[int]:
        """Decentralized entry: a member behind the newest step skips ahead to it, which becomes its mark;
        returns the data cursors of the steps it skipped (their shares are counted as dropped)."""
        skipped = []
        while self.step < step:
            skipped.append(self.cursor)
            self.step += 1
            self.cursor += global_batch
        self.mark_cursor = self.cursor
        return skipped

    def committed_view(self, impl: AlgorithmImpl) -> tuple[int, int]:
        """(step, checksum) of the newest committed state."""
        params = impl.committed_parameters()
        return self.mark(impl), checksum(params if params is not None else self.model.parameters())

    def to_state(self, impl: AlgorithmImpl, carried: dict[str, Any]) -> dict[str, Any]:
        """The committed state, with what the replica's other parts carry in it (`carried`: the data
        position, the newest record, the policy, the step metrics' names). Its tensors are the live
        model's and optimizer's own (not copies), except a periodic policy's committed parameters."""
        model = self.model.state_dict()
        committed = impl.committed_parameters()
        if committed is not None:
            model.update({name: t.detach().clone() for name, t in zip(self.param_names, committed)})
        return {"model": model, "optimizer": self.optimizer.state_dict(), "precision": self.optimizer.precision_state(),
                "step": self.mark(impl), "cursor": self.mark_cursor, "algorithm": impl.state_dict(),
                "rng": {"torch": torch.get_rng_state()}, **carried}

    def to_bytes(self, impl: AlgorithmImpl, carried: dict[str, Any]) -> bytes:
        """The committed state (`to_state`) as bytes: what a checkpoint holds, the final model."""
        buf = io.BytesIO()
        torch.save(self.to_state(impl, carried), buf)
        return buf.getvalue()

    def restore(self, state: dict[str, Any], impl: AlgorithmImpl) -> None:
        """Take a saved committed state (`read_state`) under the policy `impl` (the one it was saved under)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.load_precision_state(state.get("precision", {}))
        impl.load_state_dict(state["algorithm"])
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.mark_cursor = self.cursor
        self.holds_state = True
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
