"""BSP: synchronous gradient all-reduce over flat buckets launched from gradient hooks.

Parameters are grouped into flat buckets of about `sync.bucket_mb`, by dtype, in reverse
registration order (the order backward usually produces gradients). Each parameter's `.grad`
is a view into its bucket, so autograd accumulates straight into the buffer. A bucket's
all-reduce is launched from the post-accumulate-grad hook of its last gradient, strictly in
bucket order (every rank must issue collectives in the same order), so communication overlaps
the rest of the backward pass.

With `compression.codec` (or the `bytegrad` policy, uint8 by default) each bucket instead travels
through a compressed scatter-gather (algorithms/scatter_gather.py) once backward is done, in bucket
order; the vote is the float32 tail that scatter-gather carries on every message, so it covers both
of its collectives. Error-feedback residuals are kept when the step commits and dropped when it does
not.

The step's vote tail (loss, sample count, "I have seen a newer plan") rides at the end of the last
bucket when that bucket is float32 or float64, so the commit vote costs no extra round trip. A
bf16 or fp16 bucket cannot carry it exactly (3 x 111 samples sum to 332 in bf16), so then the tail
is a float64 tensor of its own, reduced right after the last bucket. Gradients arrive already
weighted by each rank's share of the global batch, so the SUM is the global-batch mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from algorithms.base import Algorithm, AlgorithmImpl, EpochInfo, StepVote, VoteDraft, register
from algorithms.compression import Codec, get_codec
from algorithms.scatter_gather import ScatterGather

TAIL = 3
EXACT_DTYPES = (torch.float32, torch.float64)
"""Bucket dtypes that hold the tail's sample counts exactly (up to 2**24 samples in float32)."""


@dataclass(frozen=True)
class BucketPlan:
    """Parameter indices per bucket, in launch order."""

    buckets: tuple[tuple[int, ...], ...]


def plan_buckets(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int) -> BucketPlan:
    """Group parameters (numel, dtype) into buckets in reverse order, one dtype per bucket."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_dtype: Optional[torch.dtype] = None
    for index in reversed(range(len(sizes))):
        numel, dtype = sizes[index]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if current and (dtype != current_dtype or current_bytes + nbytes > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes
        current_dtype = dtype
    if current:
        buckets.append(current)
    return BucketPlan(tuple(tuple(b) for b in buckets))


class AllReduceImpl(AlgorithmImpl):
    """Per-worker bucket state; buffers are rebuilt for every membership epoch."""

    trace: Optional[list[tuple[str, int]]] = None
    """When a list, hooks and launches append ("hook", param) / ("launch", bucket): for tests."""

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.plan = plan_buckets([(p.numel(), p.dtype) for p in self.params], int(self.config.bucket_mb * 2**20))
        self.bucket_of = {i: b for b, members in enumerate(self.plan.buckets) for i in members}
        self.codec, feedback = self._gradient_codec()
        self.tail_in_bucket = (self.codec is None and bool(self.params)
                               and self.params[self.plan.buckets[-1][0]].dtype in EXACT_DTYPES)
        """Whether the tail rides in the last bucket (exact there) or is reduced on its own."""
        self.compressed = self._wires(self.codec, feedback)
        """One compressed all-reduce per bucket; its error-feedback residuals outlive membership epochs."""
        self._vote_tail: Optional[torch.Tensor] = None
        self._draft = VoteDraft()
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))
        self._allocate()

    def _gradient_codec(self) -> tuple[Optional[Codec], bool]:
        """The codec gradients travel with (None: the plain all-reduce), and whether with error feedback."""
        compression = self.algorithm.compression
        name = compression.codec if compression is not None else "none"
        if self.algorithm.name == "bytegrad" and name == "none":
            name = "uint8"
        return (None if name == "none" else get_codec(name)), bool(compression is not None and compression.feedback)

    def _wires(self, codec: Optional[Codec], feedback: bool) -> list[ScatterGather]:
        """A compressed scatter-gather per bucket (none without a codec)."""
        if codec is None:
            return []
        return [ScatterGather(codec, sum(self.params[i].numel() for i in members), TAIL, feedback)
                for members in self.plan.buckets]

    def _allocate(self) -> None:
        """Fresh buffers (old ones may still be written by a stuck collective)."""
        self.buffers: list[torch.Tensor] = []
        self._ptrs: dict[int, int] = {}
        device = self.params[0].device if self.params else None
        self.tail_buf = torch.zeros(TAIL, dtype=torch.float64, device=device)
        for b, members in enumerate(self.plan.buckets):
            extra = TAIL if b == len(self.plan.buckets) - 1 and self.tail_in_bucket else 0
            p0 = self.params[members[0]]
            buf = torch.zeros(sum(self.params[i].numel() for i in members) + extra, dtype=p0.dtype, device=p0.device)
            offset = 0
            for i in members:
                p = self.params[i]
                view = buf[offset:offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._ptrs[i] = view.data_ptr()
                offset += p.numel()
            self.buffers.append(buf)
        self._reset_launches()

    def _reset_launches(self) -> None:
        self.handles: list = [None] * (len(self.buffers) + 1)
        self.pending = [len(m) for m in self.plan.buckets]
        self.next_launch = 0

    def on_membership(self, comm, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        self._allocate()
        for compressed in self.compressed:
            compressed.bind(comm)

    def begin_step(self, step: int, draft: VoteDraft) -> None:
        for buf in self.buffers:
            buf.zero_()
        if any(p.grad is None or p.grad.data_ptr() != self._ptrs[i] for i, p in enumerate(self.params)):
            self._allocate()  # an optimizer (or user code) replaced a .grad
        self._draft = draft
        self._reset_launches()

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if self.trace is not None:
                self.trace.append(("hook", index))
            if self.accumulating or self.comm is None or self.deferred:
                return  # an earlier micro-step (the gradient accumulates in its bucket view), or deferred
            self.pending[self.bucket_of[index]] -= 1
            self._launch_ready()

        return hook

    @property
    def deferred(self) -> bool:
        """Buckets wait for the end of backward (compressed, or a policy that sends something else)."""
        return self.codec is not None

    def _launch_ready(self, force: bool = False) -> None:
        while self.next_launch < len(self.buffers) and (force or self.pending[self.next_launch] <= 0):
            b = self.next_launch
            buf = self.buffers[b]
            last = b == len(self.buffers) - 1
            if last and self.tail_in_bucket:
                buf[-TAIL:] = self._draft.tail(buf.dtype, buf.device)
            if self.trace is not None:
                self.trace.append(("launch", b))
            self.handles[b] = self.comm.all_reduce(buf)
            if last and not self.tail_in_bucket:
                self.tail_buf.copy_(self._draft.tail(torch.float64, self.tail_buf.device))
                self.handles[-1] = self.comm.all_reduce(self.tail_buf)
            self.next_launch += 1

    def end_backward(self, step: int) -> None:
        if self.comm is None:
            return
        if not self.deferred:
            self._launch_ready(force=True)
            return
        self._reduce_deferred(self.buffers, self.compressed)

    def _reduce_deferred(self, messages: list[torch.Tensor], wires: list[ScatterGather]) -> None:
        """SUM each bucket's message in place, in bucket order, with the vote as a float32 tail on the
        last: through the bucket's compressed scatter-gather when `wires` has them, else one plain
        all-reduce of the message with the tail appended. Blocking: a failure raises CommError here."""
        device = messages[-1].device
        for b, message in enumerate(messages):
            last = b == len(messages) - 1
            tail = self._draft.tail(torch.float32, device) if last else torch.zeros(TAIL, device=device)
            if self.trace is not None:
                self.trace.append(("launch", b))
            if wires:
                summed = wires[b].all_reduce(message, tail)
            else:
                wire = torch.cat([message.view(-1), tail.to(message.dtype)])
                self.comm.all_reduce(wire).wait()
                message.view(-1).copy_(wire[:-TAIL])
                summed = wire[-TAIL:]
            if last:
                self._vote_tail = summed

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        if self.comm is None:
            return StepVote.local(draft)
        if self.deferred:
            return StepVote.reduced(self._vote_tail.to(torch.float64))
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        tail = self.buffers[-1][-TAIL:] if self.tail_in_bucket else self.tail_buf
        return StepVote.reduced(tail.to(torch.float64))

    def commit(self, step: int) -> None:
        for compressed in self.compressed:
            compressed.commit()  # keep the residuals this step staged

    def discard(self, step: int) -> None:
        for compressed in self.compressed:
            compressed.discard()


@register
class AllReduce(Algorithm):
    """BSP: average gradients over all workers every step."""

    name = "bsp"
    kind = "synchronous"
    impl = AllReduceImpl


@register
class Bytegrad(AllReduce):
    """BAGUA's ByteGrad: BSP through a compressed scatter-gather (uint8 unless `compression.codec` says)."""

    name = "bytegrad"
