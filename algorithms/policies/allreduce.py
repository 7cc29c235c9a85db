"""BSP: synchronous gradient all-reduce over flat buckets, overlapped with backward.

Two engines (`sync.engine`). Where the group is a torch process group on the parameters' device
(gloo with CPU parameters, NCCL with GPU ones) and no codec is set, `auto` runs BSP on torch's C++
`Reducer`, the core of DDP (`_start_reducer`): no Python inside backward, the vote as one more leaf
whose gradient is the tail. Everywhere else (codecs, QAdam, gloo with CUDA tensors, a modelled
latency) it runs on this module's own buckets, described next.

Parameters are grouped into flat buckets of about `sync.bucket_mb`, by dtype, in reverse
registration order (the order backward usually produces gradients). Each parameter's `.grad`
is a view into its bucket, so autograd accumulates straight into the buffer. A bucket's
all-reduce is launched from the post-accumulate-grad hook of its last gradient, strictly in
bucket order (every rank must issue collectives in the same order), so communication overlaps
the rest of the backward pass.

With `compression.codec` (or the `bytegrad` policy, uint8 by default) each bucket instead travels
through a compressed scatter-gather (algorithms/policies/scatter_gather.py) once backward is done, in bucket
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from algorithms.policies.base import Algorithm, AlgorithmImpl, EpochInfo, StepVote, VoteDraft, register, to_device
from algorithms.policies.compression import Codec, get_codec
from algorithms.policies.hierarchical import HierarchicalAllReduce
from algorithms.policies.optim import contiguous_runs, flat_view
from algorithms.policies.scatter_gather import ScatterGather
from algorithms.rules.kinds import SYNCHRONOUS
from core.comm_api import CommError, Communicator

if TYPE_CHECKING:
    from torch.distributed import Reducer

_run_backward: Callable[..., Any] | None
try:  # the C++ engine call inside torch.autograd.backward (private; absent, the public call serves)
    from torch.autograd.graph import _engine_run_backward as _run_backward
except ImportError:  # pragma: no cover - older torch
    _run_backward = None

TAIL = 3
EXACT_DTYPES = (torch.float32, torch.float64)
"""Bucket dtypes that hold the tail's sample counts exactly (up to 2**24 samples in float32)."""


@dataclass(frozen=True)
class BucketPlan:
    """Parameter indices per bucket, in launch order."""

    buckets: tuple[tuple[int, ...], ...]


LAST_BUCKET_BYTES = 2**20
"""The reducer's last bucket (the first parameters, whose gradients come last) holds at most this:
the vote's tail is appended to a copy of it, and a small last bucket is what waits after backward."""


def plan_reducer_buckets(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int) -> BucketPlan:
    """Buckets for torch's reducer, in launch order, one dtype per bucket: filled from the first
    parameter up, the first bucket (launched last) to at most LAST_BUCKET_BYTES and the others to
    `bucket_bytes`, then the list reversed, as DDP does. A parameter larger than a cap is a bucket alone."""
    forward: list[list[int]] = []
    current_bytes = 0
    for index, (numel, dtype) in enumerate(sizes):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        cap = min(LAST_BUCKET_BYTES, bucket_bytes) if len(forward) == 1 else bucket_bytes
        if forward and sizes[forward[-1][-1]][1] == dtype and current_bytes + nbytes <= cap:
            forward[-1].append(index)
            current_bytes += nbytes
        else:
            forward.append([index])
            current_bytes = nbytes
    return BucketPlan(tuple(tuple(b) for b in reversed(forward)))


def plan_buckets(sizes: list[tuple[int, torch.dtype]], bucket_bytes: int) -> BucketPlan:
    """Group parameters (numel, dtype) into buckets in reverse order, one dtype per bucket."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    current_dtype: torch.dtype | None = None
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

    trace: list[tuple[str, int]] | None = None
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
        self._vote_tail: torch.Tensor | None = None
        self._draft = VoteDraft()
        self.reducer: Reducer | None = None
        """torch's C++ reducer over this epoch's group, when BSP runs on it (see `_wants_reducer`)."""
        self._vote: torch.Tensor | None = None
        self._bytes_per_step = 0
        self._ready_hooks: list = []
        self._ready_total = self._ready_left = 0
        self._hooks: list = []
        self._zero_key: list[int] | None = None
        self._zero_runs: list[torch.Tensor] = []
        self._tail: torch.Tensor | None = None
        self._one: torch.Tensor | None = None
        self.hierarchy: HierarchicalAllReduce | None = None
        """`sync.hierarchical` over an epoch that spans nodes: the buckets are reduced through it."""
        self._python_hooks(True)
        self._allocate()

    def _gradient_codec(self) -> tuple[Codec | None, bool]:
        """The codec gradients travel with (None: the plain all-reduce), and whether with error feedback."""
        compression = self.algorithm.compression
        name = compression.codec if compression is not None else "none"
        if self.algorithm.name == "bytegrad" and name == "none":
            name = "uint8"
        return (None if name == "none" else get_codec(name)), bool(compression is not None and compression.feedback)

    def _wires(self, codec: Codec | None, feedback: bool) -> list[ScatterGather]:
        """A compressed scatter-gather per bucket (none without a codec)."""
        if codec is None:
            return []
        return [ScatterGather(codec, sum(self.params[i].numel() for i in members), self.tail_numel, feedback)
                for members in self.plan.buckets]

    def _allocate(self) -> None:
        """Fresh buffers (old ones may still be written by a stuck collective)."""
        self.buffers: list[torch.Tensor] = []
        self._ptrs: dict[int, int] = {}
        device = self.params[0].device if self.params else None
        self.tail_buf = torch.zeros(self.tail_numel, dtype=torch.float64, device=device)
        for b, members in enumerate(self.plan.buckets):
            extra = self.tail_numel if b == len(self.plan.buckets) - 1 and self.tail_in_bucket else 0
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

    @property
    def tail_numel(self) -> int:
        """The vote's width: (loss, samples, newer plan) and the step metrics."""
        return TAIL + self.vote_extras

    def refit_vote(self) -> None:
        """The step metrics' count changed at this step's first loss (before its first backward, so no
        gradient is in a bucket yet): the compressed wires' tails, and the reducer (its vote leaf) or the
        buckets (the tail's room in the last one), are rebuilt at the new width on the epoch's group."""
        for wire in self._tailed_wires():
            wire.resize_tail(self.tail_numel)
        if self.reducer is not None and self.comm is not None:
            self._drop_reducer()
            self._start_reducer(self.comm)
            self._zero_reducer_grads()
            self._ready_left = self._ready_total
        elif self.reducer is None:
            self._allocate()

    def _tailed_wires(self) -> list[ScatterGather]:
        """The compressed scatter-gathers whose messages carry the vote's tail."""
        return self.compressed

    def _reset_launches(self) -> None:
        self.handles: list = [None] * (len(self.buffers) + 1)
        self.pending = [len(m) for m in self.plan.buckets]
        self.next_launch = 0

    def on_membership(self, comm: Communicator | None, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        self._drop_reducer()  # the last epoch's
        self.hierarchy = None
        if getattr(self.config, "hierarchical", False) and comm is not None and len(set(epoch.nodes)) > 1:
            self.hierarchy = HierarchicalAllReduce(comm, epoch.rank, epoch.nodes)
        if self.hierarchy is None and comm is not None and self._wants_reducer(comm):
            self._start_reducer(comm)
            return
        self._python_hooks(True)
        self._allocate()
        for compressed in self.compressed:
            if self.hierarchy is None:
                assert comm is not None  # compressed buckets are bound to the epoch's group
                compressed.bind(comm)
            else:  # bound to the leaders' group when it forms (`_leaders_compressed`)
                compressed.discard()

    def _wants_reducer(self, comm: Communicator | None) -> bool:
        """`sync.engine`: `reducer` always (the config refused what cannot run on it), `auto` when the
        group offers a torch process group for the parameters' device (gloo: CPU; NCCL: the GPU), no
        codec is set and no network latency is modelled; `python`, a codec, QAdam or gloo with CUDA
        tensors: the bucket hooks of this class."""
        engine = getattr(self.config, "engine", "python")
        if engine == "python" or comm is None or self.codec is not None or not self.params:
            return False
        offers = getattr(comm, "process_group", None)  # in-process test groups have none
        served = getattr(comm, "device", torch.device("cpu")).type
        return engine == "reducer" or (offers is not None and offers() is not None
                                       and not getattr(comm, "models_latency", comm.latency_s > 0)
                                       and all(p.device.type == served for p in self.params))

    def _start_reducer(self, comm: Communicator) -> None:
        """torch's `Reducer` (the C++ core of DDP) on this epoch's group, with no Python on its path:
        its autograd hooks fill the buckets and launch their all-reduces in C++, and backward returns
        once every sum is in. The vote rides as one more leaf tensor of the reducer, `_vote`, placed
        in the last bucket: its gradient is the tail (loss, samples, newer plan), so the sum of the
        members' tails arrives with the gradients. The group the reducer sees has size 1, so it does
        not divide (see `GlooCommunicator.process_group`). Gradients become views into its buckets;
        this class's own buffers and hooks are dropped for the epoch."""
        import torch.distributed as dist

        offers = getattr(comm, "process_group", None)
        group = offers() if offers is not None else None
        if group is None:
            raise RuntimeError(f"sync.engine: reducer needs a torch process group; the {type(comm).__name__} "
                               f"group has none (use sync.engine: auto or python)")
        self._python_hooks(False)
        self.buffers = []
        dtype = self.params[0].dtype if self.params[0].dtype in EXACT_DTYPES else torch.float64  # its bucket: the first parameters
        device = self.params[0].device
        self._vote = torch.zeros(self.tail_numel, dtype=dtype, device=device, requires_grad=True)
        self._tail_np = np.zeros(self.tail_numel, dtype=np.float64 if dtype == torch.float64 else np.float32)
        self._tail_host = torch.from_numpy(self._tail_np)
        # The vote leaf's gradient (the engine copies it into the bucket): on the CPU the numpy array
        # itself; on a GPU a device tensor, its loss copied on the device (no host synchronization).
        self._tail = self._tail_host if device.type == "cpu" else torch.zeros(self.tail_numel, dtype=dtype, device=device)
        self._one = torch.ones((), dtype=self.params[0].dtype, device=device)
        leaves = [self._vote, *self.params]
        cap = int(self.config.bucket_mb * 2**20)
        plan = plan_reducer_buckets([(p.numel(), p.dtype) for p in leaves], cap)
        self.reducer = dist.Reducer(leaves, [list(b) for b in plan.buckets], [cap] * len(plan.buckets), group,
                                    gradient_as_bucket_view=True)
        first = next(b for b in plan.buckets if 1 in b)  # the bucket of params[0]: launched once backward is done
        self._ready_total = len([i for i in first if i > 0])
        self._ready_left = self._ready_total
        self._ready_hooks = [self.params[i - 1].register_post_accumulate_grad_hook(self._ready_hook)
                             for i in first if i > 0]
        n = comm.world_size
        self._bytes_per_step = sum(2 * (n - 1) * sum(leaves[i].numel() * leaves[i].element_size() for i in b) // n
                                   for b in plan.buckets)

    def _ready_hook(self, _param: torch.Tensor) -> None:
        """On the gradients of the reducer's last bucket (the first parameters, computed last): once all
        are in, this member's backward compute is done and what follows is the wait for the sums."""
        if self.accumulating or self.reducer is None:
            return
        self._ready_left -= 1
        if self._ready_left == 0 and self.on_gradients_ready is not None:
            self.on_gradients_ready()

    def _drop_reducer(self) -> None:
        """The reducer goes (and its autograd hooks with it), with the hooks that time its backward."""
        self.reducer = None
        for hook in self._ready_hooks:
            hook.remove()
        self._ready_hooks = []

    def detach(self) -> None:
        self._drop_reducer()
        self._python_hooks(False)

    def on_epoch_end(self, reason: str) -> None:
        """The reducer goes before its group is closed: it holds a reference to the group's backend, and
        the last reference must go in the group's release thread, never in the member's (see
        `release` in actors/transport/formation.py; dropped here after the close, the backend's destructor
        froze the process once, its worker thread waiting for the GIL the member's thread held)."""
        self._drop_reducer()

    def _python_hooks(self, on: bool) -> None:
        """Register (or remove) this class's gradient hooks: with the reducer, backward runs no Python."""
        if on and not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        elif not on:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    def backward(self, loss: torch.Tensor) -> None:
        if self.reducer is None:
            return loss.backward()
        assert self._vote is not None and self._tail is not None and self._one is not None  # set with the reducer
        assert self.comm is not None  # the reducer runs on the epoch's group (dropped before a group-less epoch)
        try:
            if self.accumulating:  # the reducer does not expect this backward: gradients accumulate
                return loss.backward()
            if self.comm.aborted:  # released already: do not launch into shut-down connections
                raise RuntimeError("membership epoch aborted")
            self.comm.at_launch()  # under `faults.kills` at allreduce, the wrapped group's member dies here
            self.reducer.prepare_for_backward([])
            draft = self._draft
            if self._tail is self._tail_host:  # the tail, written in place (CPU parameters: reading the loss costs nothing)
                tail = self._tail_np
                tail[0], tail[1], tail[2] = float(draft.loss), draft.samples, 1.0 if draft.newer_plan else 0.0
                tail[3:] = [float(e) for e in draft.extras]
            else:  # on the GPU: the loss and the metrics stay there; the two counts go up from pinned memory (no device wait)
                self._tail[:1].copy_(torch.as_tensor(draft.loss).reshape(1))
                self._tail[1:3].copy_(to_device(torch.tensor([draft.samples, 1.0 if draft.newer_plan else 0.0],
                                                             dtype=self._tail.dtype), self._tail.device))
                if draft.extras:
                    self._tail[3:].copy_(torch.stack([torch.as_tensor(e, dtype=self._tail.dtype, device=self._tail.device)
                                                      .reshape(()) for e in draft.extras]))
            self.comm.bytes_sent += self._bytes_per_step
            if _run_backward is not None and loss.shape == () and loss.dtype == self._one.dtype:
                # what torch.autograd.backward runs, without its per-call checks and a fresh ones_like
                _run_backward((loss, self._vote), (self._one, self._tail), False, False, (),
                              allow_unreachable=True, accumulate_grad=True)
            else:
                torch.autograd.backward((loss, self._vote), (None, self._tail))
        except CommError:  # a shared-memory group's all-reduce, inside backward, raises the group's own error
            self._drop_reducer()  # its state is mid-step: never reused
            raise
        except RuntimeError as err:
            # The epoch was aborted (its pairs shut down), a peer is gone, or the group timed out: the
            # reducer's wait on a bucket raised gloo's error through backward.
            if self.comm.failed or from_backend(err):
                self._drop_reducer()  # its state is mid-step: never reused
                raise self.comm.failed_in_backend(err) from None
            raise

    def begin_step(self, step: int, draft: VoteDraft) -> None:
        if self.reducer is not None:
            self._zero_reducer_grads()
            self._draft = draft
            self._ready_left = self._ready_total
            return
        for buf in self.buffers:
            buf.zero_()
        if any(p.grad is None or p.grad.data_ptr() != self._ptrs[i] for i, p in enumerate(self.params)):
            self._allocate()  # an optimizer (or user code) replaced a .grad
        self._draft = draft
        self._reset_launches()

    def _zero_reducer_grads(self) -> None:
        """Zero the gradients in the reducer's buckets: one `zero_` per bucket once the gradients are
        known to be its views (checked by address each step), else one call over them all."""
        assert self._vote is not None  # set with the reducer
        maybe = [p.grad for p in self.params]
        maybe.append(self._vote.grad)
        if any(g is None for g in maybe):  # never `None in maybe`: that compares tensors with ==, ~15 us each
            present = [g for g in maybe if g is not None]
            if present:
                torch._foreach_zero_(present)
            return
        grads = cast(list[torch.Tensor], maybe)  # none is None (checked above, without a copy)
        key = [g.data_ptr() for g in grads]
        if key != self._zero_key:
            runs = contiguous_runs(grads)
            self._zero_runs = [] if runs is None else [flat_view(grads[r[0]], sum(grads[i].numel() for i in r)) for r in runs]
            self._zero_key = key if runs is not None else None
        if self._zero_key is None:
            torch._foreach_zero_(grads)
            return
        for flat in self._zero_runs:
            flat.zero_()

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if self.reducer is not None:
                return  # torch's reducer launches this epoch's buckets
            if self.trace is not None:
                self.trace.append(("hook", index))
            if self.accumulating or self.comm is None or self.deferred:
                return  # an earlier micro-step (the gradient accumulates in its bucket view), or deferred
            self.pending[self.bucket_of[index]] -= 1
            self._launch_ready()

        return hook

    @property
    def deferred(self) -> bool:
        """Buckets wait for the end of backward (compressed, hierarchical, or a policy that sends
        something else)."""
        return self.codec is not None or self.hierarchy is not None

    def _launch_ready(self, force: bool = False) -> None:
        assert self.comm is not None  # buckets launch only in an epoch with a group (the hook and end_backward check)
        while self.next_launch < len(self.buffers) and (force or self.pending[self.next_launch] <= 0):
            b = self.next_launch
            buf = self.buffers[b]
            last = b == len(self.buffers) - 1
            if last and self.tail_in_bucket:
                buf[-self.tail_numel:] = self._draft.tail(buf.dtype, buf.device)
            if self.trace is not None:
                self.trace.append(("launch", b))
            self.handles[b] = self.comm.all_reduce(buf)
            if last and not self.tail_in_bucket:
                self.tail_buf.copy_(self._draft.tail(torch.float64, self.tail_buf.device))
                self.handles[-1] = self.comm.all_reduce(self.tail_buf)
            self.next_launch += 1

    def end_backward(self, step: int) -> None:
        if self.comm is None or self.reducer is not None:
            return
        if not self.deferred:
            self._launch_ready(force=True)
            return
        self._reduce_deferred(self.buffers, self.compressed)

    def _reduce_deferred(self, messages: list[torch.Tensor], wires: list[ScatterGather]) -> None:
        """SUM each bucket's message in place, in bucket order, with the vote as a float32 tail on the
        last: through the bucket's compressed scatter-gather when `wires` has them, else one plain
        all-reduce of the message with the tail appended. Blocking: a failure raises CommError here."""
        comm = self.comm
        assert comm is not None  # end_backward reduces only in an epoch with a group
        device = messages[-1].device
        for b, message in enumerate(messages):
            last = b == len(messages) - 1
            tail = self._draft.tail(torch.float32, device) if last else torch.zeros(self.tail_numel, device=device)
            if self.trace is not None:
                self.trace.append(("launch", b))
            if wires and self.hierarchy is None:
                summed = wires[b].all_reduce(message, tail)
            else:
                wire = torch.cat([message.view(-1), tail.to(message.dtype)])
                if self.hierarchy is not None:
                    self.hierarchy.all_reduce(wire, self._leaders_compressed(wires[b]) if wires else None)
                else:
                    comm.all_reduce(wire).wait()
                message.view(-1).copy_(wire[:-self.tail_numel])
                summed = wire[-self.tail_numel:]
            if last:
                self._vote_tail = summed

    def _leaders_compressed(self, wire: ScatterGather):
        """Hierarchical with a codec: the leaders' part, the bucket's compressed scatter-gather on the
        leaders' own group (bound to it at its first use in the membership epoch); the vote's tail is
        summed alongside, as in the flat path."""
        comm = self.comm
        assert comm is not None  # made by _reduce_deferred, for the epoch's group

        def among(flat: torch.Tensor, group) -> None:
            if wire.comm is not group:
                wire.bind(group)
            n = self.tail_numel
            flat[-n:] = wire.all_reduce(flat[:-n], flat[-n:].to(torch.float32)).to(flat.dtype)
            comm.bytes_sent += wire.bytes_sent  # the job counts what the epoch's members sent
        return among

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        if self.comm is None:
            return StepVote.local(draft)
        if self.reducer is not None:  # backward returned: every bucket's sum is in
            try:
                self.reducer._check_reducer_finalized()
            except RuntimeError:
                raise RuntimeError("the reducer did not finish this step's buckets: some parameter got no "
                                   "gradient; sync.engine: python reduces models with unused parameters") from None
            synchronize = getattr(self.comm, "synchronize", None)
            assert self._vote is not None  # set with the reducer
            if self._vote.is_cuda and synchronize is not None:
                synchronize()  # the reducer's NCCL work, waited for with the epoch's abort and timeout
            summed = self._vote.grad
            assert summed is not None  # backward's reducer wrote the sum of the tails there
            return StepVote.reduced(summed)  # float32 or float64: sample counts exact either way
        if self.deferred:
            assert self._vote_tail is not None  # end_backward's deferred reduce set it
            return StepVote.reduced(self._vote_tail.to(torch.float64))
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        tail = self.buffers[-1][-self.tail_numel:] if self.tail_in_bucket else self.tail_buf
        return StepVote.reduced(tail.to(torch.float64))

    def commit(self, step: int) -> None:
        for compressed in self.compressed:
            compressed.commit()  # keep the residuals this step staged

    def discard(self, step: int) -> None:
        for compressed in self.compressed:
            compressed.discard()


def from_backend(err: RuntimeError) -> bool:
    """Whether a RuntimeError out of backward is the backend's (a bucket's all-reduce failed: gloo's
    or NCCL's), not the model's."""
    text = str(err)
    return "gloo" in text or "pair closure" in text or "Connection closed" in text or "NCCL" in text


@register
class AllReduce(Algorithm):
    """BSP: average gradients over all workers every step."""

    name = "bsp"
    kind = SYNCHRONOUS
    impl = AllReduceImpl


@register
class Bytegrad(AllReduce):
    """BAGUA's ByteGrad: BSP through a compressed scatter-gather (uint8 unless `compression.codec` says)."""

    name = "bytegrad"
