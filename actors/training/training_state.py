"""A replica's training state: the model, the optimizer, the step, the data cursor and the newest
commit point's mark; its bytes (what a joiner receives, what a checkpoint holds, the final model)
and checksum; and the moves to another committed state (commit, rewind, skip ahead, restore).

`TrainingState` is the only writer of these fields. The policy running decides where the commit
point is (a periodic policy's local steps stay provisional until its round): every method that
needs it is passed the policy's implementation, which the replica's `PolicyBinding` holds.
"""
from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch

from actors.training.state_transfer import flat_bytes
from algorithms.policies.base import AlgorithmImpl
from algorithms.policies.precision import GuardedOptimizer, Precision

DIGEST_CHUNK_WORDS = 1 << 16
"""The digest reads a tensor's bytes as 32-bit words in chunks of 2**16 (256 KiB)."""
DIGEST_SLAB_CHUNKS = {"cpu": 4, "cuda": 512}
"""How many chunks one pass reduces at once (its int64 copy is 2 MiB on the CPU, 256 MiB on a GPU):
few kernel launches on a GPU, little memory on the CPU. It does not change the digest."""

_POSITION = 0x9E3779B97F4A7C15 - (1 << 64)  # odd: word i's weight is i * _POSITION | 1 (as int64)
_CHUNK = 0x5851F42D4C957F2D  # odd: chunk k's multiplier is (2k + 1) * _CHUNK (as int64)
_weights: dict[tuple[torch.device, int], torch.Tensor] = {}


def _chunk_weights(device: torch.device) -> torch.Tensor:
    """One odd int64 weight per word of a chunk, made once per device (512 KiB)."""
    key = (device, DIGEST_CHUNK_WORDS)
    if key not in _weights:
        _weights[key] = torch.arange(DIGEST_CHUNK_WORDS, device=device, dtype=torch.int64).mul_(_POSITION).bitwise_or_(1)
    return _weights[key]


def _int64(value: int) -> int:
    """`value` wrapped to a signed 64-bit integer, as int64 arithmetic leaves it."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (the last one padded with zero bytes)."""
    raw = flat_bytes(t.detach())
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    try:
        return raw.view(torch.int32)
    except RuntimeError:  # a view at a storage offset that is not a multiple of 4 bytes
        return raw.clone().view(torch.int32)


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """A 64-bit digest of the tensors' bytes in order (any dtype: bytes are viewed raw), computed where
    the tensors are: on a GPU, one 8-byte value reaches the host, not the model.

    Each tensor's words are cut into chunks of `DIGEST_CHUNK_WORDS` (its last one shorter), numbered k
    across the tensors; the digest is sum_k m_k sum_i w_i x_ki in int64 (wrapping), with w_i = i*P | 1
    and m_k = (2k + 1)*M, P and M odd: changing any one word changes it (its difference times an odd
    number is never 0 mod 2**64), as does moving a word to another position. It checks that members
    hold the same state; it is not a cryptographic hash."""
    total: torch.Tensor | None = None
    chunk = 0
    for t in tensors:
        words = _words(t)
        device = words.device
        weights = _chunk_weights(device)
        n, c = words.numel(), DIGEST_CHUNK_WORDS
        slab = DIGEST_SLAB_CHUNKS.get(device.type, DIGEST_SLAB_CHUNKS["cpu"])
        full = n // c
        for first in range(0, full, slab):  # whole chunks, `slab` at a time: one row each
            rows = min(slab, full - first)
            sums = words[first * c:(first + rows) * c].view(rows, c).to(torch.int64).mul_(weights).sum(dim=1)
            scales = torch.arange(chunk + first, chunk + first + rows, device=device, dtype=torch.int64) \
                .mul_(2).add_(1).mul_(_CHUNK)
            term = sums.mul_(scales).sum()
            total = term if total is None else total.add_(term)
        if n % c:  # the tensor's last, shorter chunk
            part = words[full * c:]
            term = part.to(torch.int64).mul_(weights[:part.numel()]).sum().mul_(_int64((2 * (chunk + full) + 1) * _CHUNK))
            total = term if total is None else total.add_(term)
        chunk += full + (1 if n % c else 0)
    return 0 if total is None else int(total)


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
        """(step, checksum) of the newest committed state (of this member's shards, where it holds shards)."""
        params = impl.committed_parameters()
        return self.mark(impl), checksum(_local(p) for p in (params if params is not None else self.model.parameters()))

    def adopt(self, model: torch.nn.Module, optimizer: GuardedOptimizer) -> None:
        """Train `model` with `optimizer` from now on, at the step where it stands (a replica group's entry
        re-cuts the replica into a new model and optimizer over the new group)."""
        self.model, self.optimizer = model, optimizer
        self.holds_state = True

    def position(self, impl: AlgorithmImpl, carried: dict[str, Any]) -> dict[str, Any]:
        """Where the committed state stands, without its model and optimizer: its step and data cursor, the
        policy's state, the random generator's, and what the replica's other parts carry (`carried`: the
        data position, the newest record, the policy, the step metrics' names)."""
        return {"step": self.mark(impl), "cursor": self.mark_cursor, "algorithm": impl.state_dict(),
                "rng": {"torch": torch.get_rng_state()}, **carried}

    def to_state(self, impl: AlgorithmImpl, carried: dict[str, Any],
                 whole: tuple[dict[str, Any], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The committed state (`position`, with the model's and the optimizer's). Its tensors are the live
        model's and optimizer's own (not copies), except a periodic policy's committed parameters;
        `whole`: (the model's state, the optimizer's) gathered whole from a replica group, instead."""
        if whole is not None:
            model, optimizer = whole
        else:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
            committed = impl.committed_parameters()
            if committed is not None:
                model.update({name: t.detach().clone() for name, t in zip(self.param_names, committed)})
        return {"model": model, "optimizer": optimizer, "precision": self.optimizer.precision_state(),
                **self.position(impl, carried)}

    def to_bytes(self, impl: AlgorithmImpl, carried: dict[str, Any],
                 whole: tuple[dict[str, Any], dict[str, Any]] | None = None) -> bytes:
        """The committed state (`to_state`) as bytes: what a checkpoint holds, the final model."""
        buf = io.BytesIO()
        torch.save(self.to_state(impl, carried, whole), buf)
        return buf.getvalue()

    def restore(self, state: dict[str, Any], impl: AlgorithmImpl) -> None:
        """Take a saved committed state (`read_state`) under the policy `impl` (the one it was saved under)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.load_precision_state(state.get("precision", {}))
        self.restore_position(state, impl)

    def restore_position(self, state: dict[str, Any], impl: AlgorithmImpl) -> None:
        """Stand where a committed state stands (`position`: its step, cursor, policy state and generator)."""
        impl.load_state_dict(state["algorithm"])
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.mark_cursor = self.cursor
        self.holds_state = True
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This member's part of a tensor that may be a shard (a DTensor of FSDP's)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
