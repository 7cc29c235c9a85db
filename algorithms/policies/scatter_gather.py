"""Compressed SUM all-reduce by scatter-gather (BAGUA's ByteGrad form), carrying the step's vote.

One flat tensor of d elements over n ranks: pad to n * m elements (m = ceil(d / n), zeros), split
into n chunks, compress each, all-to-all (chunk i to rank i), decompress, sum the n copies of the
chunk this rank owns (in rank order 0..n-1, from zero), recompress it, all-gather, decompress every
chunk. Every message is [codec payload | float32 vote tail]: each rank appends its tail to every
all-to-all chunk, each owner sums the n tails it received, and the all-gather returns the sums; the
tail a call returns is the one received from rank (rank + 1) % n, so a vote exists only if both
collectives succeeded on this rank.

Error feedback (optional; required by biased codecs such as 1-bit) works on both halves: a worker
adds its residual before compressing its chunks, an owner adds its own before recompressing its
sum. Residuals are staged and kept only by `commit()` (after the step's vote commits); a call that
raises discards them. `bind()` starts a membership epoch: fresh wire buffers (an aborted collective
may still write into the old ones) and the owner residual reset, since the owned chunk changes; the
worker residual covers the whole unpadded tensor and survives.

The communicator is injected (algorithms/ never imports a backend); its `bytes_sent` counter is
the one byte formula, and `bytes_sent` here is its growth over the last call.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from algorithms.policies.compression import Codec, ErrorFeedback
from core.comm_api import Communicator

_TAIL_DTYPE = torch.float32


class ScatterGather:
    """The compressed all-reduce of one flat tensor of `numel` elements, bound to one group at a time."""

    def __init__(self, codec: Codec, numel: int, tail_numel: int = 3, feedback: bool = False) -> None:
        if codec.needs_feedback and not feedback:
            raise ValueError(f"compression.codec {codec.name!r} needs error feedback on both halves "
                             "(a biased codec drifts without it): enable it")
        self.codec = codec
        self.numel = numel
        self.tail_numel = tail_numel
        self.worker_feedback: ErrorFeedback | None = ErrorFeedback() if feedback else None
        self.owner_feedback: ErrorFeedback | None = ErrorFeedback() if feedback else None
        self.comm: Communicator | None = None
        """The group's communicator once bound (`bind`)."""
        self.bytes_sent = 0
        """Bytes this rank's communicator counted during the last call."""

    def bind(self, comm: Communicator) -> None:
        """Start a membership epoch on `comm`: new buffers, owner residual reset, worker residual kept."""
        self.comm = comm
        n = comm.world_size
        device = getattr(comm, "device", torch.device("cpu"))
        self.chunk = -(-self.numel // n)
        self.payload = self.codec.payload_bytes(self.chunk)
        self.message = self.payload + self.tail_numel * _TAIL_DTYPE.itemsize
        wire: dict[str, Any] = dict(dtype=torch.uint8, device=device)
        self._send = torch.zeros(n, self.message, **wire)
        self._recv = torch.zeros(n, self.message, **wire)
        self._gather_in = torch.zeros(self.message, **wire)
        self._gathered = self._send  # the all-to-all has finished with it when the all-gather starts
        self._padded = torch.zeros(self.chunk, device=device)
        self._decoded = torch.empty(self.chunk, device=device)
        self._owned = torch.empty(self.chunk, device=device)
        self._tail_sum = torch.empty(self.tail_numel, dtype=_TAIL_DTYPE, device=device)
        if self.owner_feedback is not None:
            self.owner_feedback.reset()
        if self.worker_feedback is not None:
            self.worker_feedback.discard()

    def resize_tail(self, tail_numel: int) -> None:
        """Carry a tail of `tail_numel` from the next call on (the vote gained or lost step metrics at a
        step's first loss, before any call of that step): a bound one is bound again to its group."""
        if tail_numel == self.tail_numel:
            return
        self.tail_numel = tail_numel
        if self.comm is not None:
            self.bind(self.comm)

    @property
    def _group(self) -> Communicator:
        """The bound communicator (every call but `bind` needs one)."""
        assert self.comm is not None, "bind() a group first"
        return self.comm

    def wire_bytes(self) -> int:
        """What one call sends from this rank: n - 1 messages in each collective."""
        return 2 * (self._group.world_size - 1) * self.message

    def all_reduce(self, tensor: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` (contiguous, `numel` elements) by its SUM over the group; return the SUM
        of `tail` (float32, `tail_numel` elements) as delivered by the all-gather. A call that raises
        leaves its collectives' buffers to the failed group: `bind()` a new one before the next call."""
        if tensor.numel() != self.numel or tail.numel() != self.tail_numel:
            raise ValueError(f"expected {self.numel} elements and a tail of {self.tail_numel}, "
                             f"got {tensor.numel()} and {tail.numel()}")
        before = self._group.bytes_sent
        try:
            flat = tensor.view(-1)
            self._compress_chunks(flat, tail.detach().to(_TAIL_DTYPE).contiguous().view(-1))
            self._group.all_to_all(self._recv.view(-1), self._send.view(-1)).wait()
            self._reduce_own_chunk()
            outputs = list(self._gathered.unbind(0))
            self._group.all_gather(outputs, self._gather_in).wait()
            self._decompress_all(flat)
        except BaseException:
            self.discard()
            raise
        finally:
            self.bytes_sent = self._group.bytes_sent - before
        peer = (self._group.rank + 1) % self._group.world_size
        return self._gathered[peer, self.payload:].view(_TAIL_DTYPE).clone()

    def commit(self) -> None:
        """The step committed: keep the residuals this call staged."""
        for feedback in (self.worker_feedback, self.owner_feedback):
            if feedback is not None:
                feedback.commit()

    def discard(self) -> None:
        """The step did not commit: keep the residuals from before it."""
        for feedback in (self.worker_feedback, self.owner_feedback):
            if feedback is not None:
                feedback.discard()

    def _chunks(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        """The n chunks of `flat`, padded with zeros where the tensor ends inside (or before) one.
        A padded chunk lives in one scratch buffer: use each before asking for the next."""
        for i in range(self._group.world_size):
            part = flat[i * self.chunk:(i + 1) * self.chunk]
            if part.numel() == self.chunk:
                yield part
                continue
            self._padded[:part.numel()].copy_(part)
            self._padded[part.numel():].zero_()
            yield self._padded

    def _compress_chunks(self, flat: torch.Tensor, tail: torch.Tensor) -> None:
        source = flat
        if self.worker_feedback is not None:
            staging = self.worker_feedback.buffer(self.numel, flat.device)
            source = self.worker_feedback.compensate(flat, out=staging)
        tail_bytes = tail.view(torch.uint8)
        for i, chunk in enumerate(self._chunks(source)):
            self.codec.compress(chunk, out=self._send[i, :self.payload])
            self._send[i, self.payload:] = tail_bytes
            if self.worker_feedback is not None:
                lost = source[i * self.chunk:(i + 1) * self.chunk]
                decoded = self.codec.decompress(self._send[i, :self.payload], self.chunk, out=self._decoded)
                lost.sub_(decoded[:lost.numel()])
        if self.worker_feedback is not None:
            self.worker_feedback.stage(source)

    def _reduce_own_chunk(self) -> None:
        owned = self._owned.zero_()
        tail_sum = self._tail_sum.zero_()
        for j in range(self._group.world_size):
            owned.add_(self.codec.decompress(self._recv[j, :self.payload], self.chunk, out=self._decoded))
            tail_sum.add_(self._recv[j, self.payload:].view(_TAIL_DTYPE))
        if self.owner_feedback is not None:
            owned = self.owner_feedback.compensate(owned, out=self.owner_feedback.buffer(self.chunk, owned.device))
        self.codec.compress(owned, out=self._gather_in[:self.payload])
        self._gather_in[self.payload:] = tail_sum.view(torch.uint8)
        if self.owner_feedback is not None:
            owned.sub_(self.codec.decompress(self._gather_in[:self.payload], self.chunk, out=self._decoded))
            self.owner_feedback.stage(owned)

    def _decompress_all(self, flat: torch.Tensor) -> None:
        for j in range(self._group.world_size):
            decoded = self.codec.decompress(self._gathered[j, :self.payload], self.chunk, out=self._decoded)
            part = flat[j * self.chunk:(j + 1) * self.chunk]
            part.copy_(decoded[:part.numel()])
