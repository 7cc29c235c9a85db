"""Periodic averaging: local SGD, DiLoCo and streaming DiLoCo. Pure torch; the communicator is given.

Every member takes local steps with the configured (inner) optimizer, whose state stays local.
At a *round* the members combine their replicas with one all-reduce that also carries the vote;
a round is the commit point of the local steps since the previous one.

- `local_sgd` (`h`): every `h` steps, x <- sum_i n_i x_i / sum_i n_i, with n_i the samples member i
  trained since the last round (so with `h: 1` and SGD this is BSP on the same global batches).
- `diloco` (`h`, `outer_lr`, `outer_momentum`, `nesterov`): every `h` steps the members average the
  pseudo-gradient d = x_global - x_i (weighted the same way), the outer optimizer (SGD with momentum,
  Nesterov by default) steps the global parameters with it, and every member adopts them. The
  outer state is the same on every member; it travels to joiners and into checkpoints.
- `streaming_diloco` (+ `fragments`, `overlap`, `alpha`): the flattened parameters are cut into
  `fragments` equal slices, so a round sends 1 / F of them. Fragment f is synchronized after steps
  (f + 1) h / F + k h: its pseudo-gradient's all-reduce launches after that step's update and is
  merged `overlap` steps later as x_f <- alpha x_f(outer) + (1 - alpha) x_f(local); the local steps in
  between overlap the communication. With `overlap: 0` nothing ran in between and the merge adopts
  the outer parameters (so one fragment without overlap is `diloco`).

With `compression.codec`, a round's payload (the weighted parameters, or pseudo-gradient) travels
through the compressed scatter-gather of algorithms/policies/scatter_gather.py instead, one per fragment, and
the vote rides in its float32 tail (sample counts exact up to 2**24 per round). Its two collectives
run when the round launches (the owners' reduction needs the all-to-all's result), so with a codec
streaming's local steps no longer hide the communication; what the merge computes is unchanged.
Error-feedback residuals (`compression.feedback`) are staged by the round's launch and kept only when
its vote commits; a new membership resets the owners' residuals, as for `bsp`.

Under churn (see actors/training/replica.py for the epoch entry): the state every member agrees on is the
newest *committed* one, the replica as it was after the last round (`committed_parameters`,
`commit_mark`). When a round's all-reduce fails, the local steps stay and the round is due again
in the next membership epoch; if some member did commit that round, the others take its state.

Memory beyond the model and optimizer: `local_sgd` keeps one copy of the parameters (the committed
replica), `diloco` one (the global parameters, from which the committed replica is rebuilt) plus
the outer momentum, `streaming_diloco` two plus the outer momentum. A codec adds, per fragment, its
scatter-gather's wire buffers (about two compressed copies) and, with feedback, two float32 copies
for the worker residual.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from algorithms.policies.base import Algorithm, AlgorithmImpl, EpochInfo, StepVote, VoteDraft, register
from algorithms.policies.compression import get_codec
from algorithms.policies.optim import SGD
from algorithms.policies.scatter_gather import ScatterGather
from algorithms.rules.kinds import PERIODIC
from core.comm_api import Communicator


@dataclass
class _Launch:
    """A fragment's round in flight: launched after step `step`, merged after step `merge_at`."""

    fragment: int
    step: int
    merge_at: int
    flat: torch.Tensor
    tail: torch.Tensor
    handles: list
    trained: int = 0
    """The member's `trained` at the launch: the fragment's next round counts the samples after it
    (the overlap steps' included)."""


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """`fragments` equal slices [start, end) of a flat vector of `numel` elements (never empty)."""
    count = max(1, min(fragments, numel))
    cuts = [round(k * numel / count) for k in range(count + 1)]
    return [(cuts[k], cuts[k + 1]) for k in range(count)]


class PeriodicImpl(AlgorithmImpl):
    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        cfg = self.config
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.h = cfg.h
        self.outer_mode = cfg.policy != "local_sgd"
        self.streaming = cfg.policy == "streaming_diloco"
        self.overlap = cfg.overlap if self.streaming else 0
        self.alpha = cfg.alpha if self.streaming else 1.0
        self.bounds = fragment_bounds(sum(p.numel() for p in self.params), cfg.fragments if self.streaming else 1)
        self.anchor: list[torch.Tensor] = []
        """Per fragment, the global (outer) parameters as of its last round (DiLoCo only)."""
        self.outer: SGD | None = None
        if self.outer_mode:
            self.anchor = [self._gather(f).clone() for f in range(len(self.bounds))]
            self.outer = SGD(self.anchor, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov)
        self.wires = self._wires()
        """Per fragment, the compressed scatter-gather of its rounds (none without a codec)."""
        self.snapshot: list[torch.Tensor] = [] if self.outer_mode and not self.streaming else [
            p.detach().clone() for p in self.params]
        """The replica as of the last commit (for diloco it is rebuilt from `anchor`)."""
        self.mark = 0
        """The step of the newest committed round."""
        self.last_sync = [0] * len(self.bounds)
        """Per fragment, the step of its last committed round."""
        self.trained = 0
        """Samples this member trained in all; `since[f]` was the count at fragment f's last round."""
        self.since = [0] * len(self.bounds)
        self.mark_trained = 0
        """`trained` at the last commit (a rewind goes back to it)."""
        self.step_losses: list[tuple[int, Any, tuple]] = []  # as VoteDraft holds them: floats or 0-d tensors
        """(`trained` after the step, its mean loss, its step metrics) of the local steps a round may still
        cover: a round reports the mean loss (and metrics) of the steps it covers (those since its
        fragment's previous launch)."""
        self.inflight: _Launch | None = None
        self._due: int | None = None
        self._final = False

    def _wires(self) -> list[ScatterGather]:
        compression = self.algorithm.compression
        if compression is None or compression.codec == "none":
            return []
        codec = get_codec(compression.codec)
        return [ScatterGather(codec, end - start, 3 + self.vote_extras, compression.feedback) for start, end in self.bounds]

    def refit_vote(self) -> None:
        """The step metrics' count changed at a local step (no round is in flight before the first one):
        each fragment's compressed round carries the wider tail."""
        for wire in self.wires:
            wire.resize_tail(3 + self.vote_extras)

    # ------------------------------------------------------------------ flat fragments
    def _pieces(self, f: int):
        """(parameter, start, end, offset) for the parts of each parameter inside fragment f."""
        start, end = self.bounds[f]
        offset = 0
        for p in self.params:
            a, b = max(start - offset, 0), min(end - offset, p.numel())
            if a < b:
                yield p, a, b, offset + a - start
            offset += p.numel()

    def _gather(self, f: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1)[a:b].to(self.dtype) for p, a, b, _ in self._pieces(f)])

    def _scatter(self, f: int, flat: torch.Tensor, into: list[torch.Tensor] | None = None) -> None:
        targets = dict(zip(map(id, self.params), into)) if into is not None else None
        with torch.no_grad():
            for p, a, b, at in self._pieces(f):
                dest = p if targets is None else targets[id(p)]
                dest.view(-1)[a:b].copy_(flat[at:at + b - a])

    # ------------------------------------------------------------------ schedule
    def _offset(self, f: int) -> int:
        return (f + 1) * self.h // len(self.bounds)

    def _due_fragment(self, step: int) -> int | None:
        """The fragment whose round launches after `step`, if any (at the end of the run every
        fragment not yet synchronized at that step is)."""
        if self._final:
            return next((f for f, last in enumerate(self.last_sync) if last < step), None)
        for f in range(len(self.bounds)):
            offset = self._offset(f)
            if step >= offset and (step - offset) % self.h == 0 and self.last_sync[f] < step:
                return f
        return None

    def sync_due(self, step: int, stop_at: int | None) -> bool:
        self._final = stop_at is not None and step >= stop_at
        if self.inflight is not None:
            return step >= self.inflight.merge_at or self._final
        self._due = self._due_fragment(step)
        return self._due is not None

    # ------------------------------------------------------------------ local steps
    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        self.trained += draft.samples
        self.step_losses.append((self.trained, draft.loss, draft.extras))
        return StepVote.local(draft)

    # ------------------------------------------------------------------ rounds
    def sync(self, step: int, draft: VoteDraft) -> StepVote | None:
        """Launch the due fragment's round (after `sync_due` said one is due) and/or merge the one in
        flight; the merge is the commit point and returns the vote, a launch alone returns None. A
        failed collective raises CommError."""
        if self.inflight is None:
            assert self._due is not None  # sync_due found the due fragment
            self.inflight = self._launch(self._due, step, draft)
            if self.inflight.merge_at > step:
                return None
        return self._merge(step)

    def _launch(self, f: int, step: int, draft: VoteDraft) -> _Launch:
        n = float(self.trained - self.since[f])
        local = self._gather(f)
        flat = (self.anchor[f] - local if self.outer_mode else local) * n
        covered = [(loss, *extras) for after, loss, extras in self.step_losses if after > self.since[f]]
        means = [sum(column) / len(covered) for column in zip(*covered)] if covered else [0.0] * (1 + self.vote_extras)
        draft = VoteDraft(loss=means[0] * n, samples=int(n), newer_plan=draft.newer_plan,
                          extras=tuple(m * n for m in means[1:]))
        if self.wires:  # blocking: both collectives of the scatter-gather, the vote in their tail
            tail = self.wires[f].all_reduce(flat, draft.tail(torch.float32, flat.device)).to(torch.float64)
            handles = []
        else:
            tail = draft.tail(torch.float64, flat.device)
            assert self.comm is not None  # a round without compression runs on the epoch's group
            handles = [self.comm.all_reduce(flat), self.comm.all_reduce(tail)]
        return _Launch(f, step, step if self._final else step + self.overlap, flat, tail, handles, self.trained)

    def _merge(self, step: int) -> StepVote:
        launch = self.inflight
        assert launch is not None  # a round is in flight (sync launched it)
        f = launch.fragment
        for handle in launch.handles:
            handle.wait()
        self.inflight = None
        total = float(launch.tail[1])
        mean = launch.flat / max(total, 1.0)
        if self.outer_mode:
            for k, a in enumerate(self.anchor):
                a.grad = mean if k == f else None
            assert self.outer is not None  # built in outer mode
            self.outer.step()
            self.anchor[f].grad = None
            mean = self.anchor[f]
        if step > launch.step:  # local steps ran meanwhile: blend them in
            mean = torch.lerp(self._gather(f), mean, self.alpha)
        self._scatter(f, mean)
        # A blended merge synchronized the fragment as of its launch, with local steps on top: at the
        # end of the run it is due once more, so that every replica ends at the exact average.
        self.last_sync[f] = launch.step if step > launch.step else step
        self.since[f] = launch.trained  # what the round covered; the overlap steps belong to the next
        oldest = min(self.since)
        self.step_losses = [entry for entry in self.step_losses if entry[0] > oldest]
        return StepVote(True, float(launch.tail[0]) / max(total, 1.0), int(round(total)), bool(launch.tail[2] > 0),
                        extras=tuple(float(e) / max(total, 1.0) for e in launch.tail[3:]))

    def commit(self, step: int) -> None:
        """The round's vote passed: this is the newest committed state."""
        self.mark = step
        self.mark_trained = self.trained
        with torch.no_grad():
            for s, p in zip(self.snapshot, self.params):
                s.copy_(p.detach())
        for wire in self.wires:
            wire.commit()  # keep the residuals the round staged

    def start_at(self, step: int) -> None:
        """Switched to at `step`: the replica (bound now, so `snapshot` and `anchor` hold it) is the
        committed state of `step`, and every fragment's last round is `step` (the first is h steps on)."""
        self.mark, self.mark_trained = step, self.trained
        self.last_sync = [step] * len(self.bounds)
        self.since = [self.trained] * len(self.bounds)

    def discard(self, step: int) -> None:
        """The round's vote failed: its staged residuals are dropped (the round is redone)."""
        for wire in self.wires:
            wire.discard()

    def on_epoch_end(self, reason: str) -> None:
        self.inflight = None  # its buffers are abandoned with the group; the round is due again

    def on_membership(self, comm: Communicator | None, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        self.inflight = None
        for wire in self.wires:
            assert comm is not None  # a compressed round runs on the epoch's group
            wire.bind(comm)  # also drops what an abandoned round staged

    @property
    def commit_mark(self) -> int | None:
        return self.mark

    @property
    def replicas_agree_at_commit(self) -> bool:
        """Streaming with several fragments (a round merges one; the others hold each member's own
        progress) or alpha < 1 (a merge blends in the local steps): members differ at a commit point."""
        return not (self.streaming and (len(self.bounds) > 1 or self.alpha < 1))

    def committed_parameters(self) -> list[torch.Tensor]:
        if self.snapshot:
            return self.snapshot
        replica = [p.detach().clone() for p in self.params]
        for f, flat in enumerate(self.anchor):
            self._scatter(f, flat, into=replica)
        return replica

    def rewind(self) -> None:
        committed = self.committed_parameters()
        with torch.no_grad():
            for p, c in zip(self.params, committed):
                p.copy_(c)
        self.trained = self.mark_trained
        self.step_losses = [entry for entry in self.step_losses if entry[0] <= self.trained]
        self.inflight = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"anchor": [a.detach().clone() for a in self.anchor],
                "outer": copy.deepcopy(self.outer.state_dict()) if self.outer is not None else None,
                "mark": self.mark, "last_sync": list(self.last_sync), "trained": self.mark_trained,
                "since": list(self.since)}

    def load_state_dict(self, state: dict) -> None:
        """A joiner, or a member behind, takes a holder's committed state (the model comes with it)."""
        if not state:
            return
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
        self.mark, self.last_sync = int(state["mark"]), list(state["last_sync"])
        self.trained = self.mark_trained = int(state["trained"])
        self.since = list(state["since"])
        self.step_losses, self.inflight = [], None
        with torch.no_grad():
            for s, p in zip(self.snapshot, self.params):
                s.copy_(p.detach())


@register
class LocalSGD(Algorithm):
    """Local SGD: `h` local steps, then the replicas are averaged."""

    name = "local_sgd"
    kind = PERIODIC
    impl = PeriodicImpl


@register
class DiLoCo(Algorithm):
    """DiLoCo: an outer optimizer on the averaged pseudo-gradient every `h` inner steps."""

    name = "diloco"
    kind = PERIODIC
    impl = PeriodicImpl


@register
class StreamingDiLoCo(Algorithm):
    """Streaming DiLoCo: DiLoCo by staggered fragments whose communication overlaps local steps."""

    name = "streaming_diloco"
    kind = PERIODIC
    impl = PeriodicImpl
