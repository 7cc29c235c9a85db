"""The policy seam: the `Algorithm` interface, the step vote, and the registry. Pure: no Ray.

An `Algorithm` holds one policy's settings (its config dataclass, parsed from `sync:`) and says
what kind of policy it is; `bind()` makes the per-worker `AlgorithmImpl`, which the worker's step
loop (actors/training/replica.py) drives through these hooks, in this order:

    on_membership(comm, epoch)   once per membership epoch: buffers, peers, server handles
    step_samples(step)           a policy that deals the step's samples (server kinds: pull) names them
    begin_step(step, draft)      `draft` is this member's side of the step's vote, filled in as the
                                 step runs (the loss before each backward, so that a bucket launched
                                 from the last gradient hook can carry the vote)
    before_forward(step)         gossip policies launch their exchange here
    ... forward and `backward(loss)`, once per micro-step (`accumulating` is true on all but the
        last); gradient hooks may launch communication ...
    end_backward(step)           launch whatever is left
    finish_step(step, draft)     wait for the step's communication; return the `StepVote` (a failed
                                 collective raises CommError: the step is not committed)
    apply_update(step, lr)       on a committed vote: the update (default: `optimizer.step()`)
    sync_due(step, stop_at) / sync(step, draft)  a periodic round, when one is due: its vote
    commit(step) / discard(step) keep or roll back what the policy staged for this step or round
    on_epoch_end(reason)         the epoch is over: abort and abandon background work
    close()                      the member's run ended: stop background work, flush notices
    state_dict / load_state_dict what a joiner or a checkpoint needs of the policy

What a step means, what commits it, who reports history and how a membership epoch is entered
all follow from the policy's `kind`:

| kind          | commit point                          | entry      | history from | loss per member | stops at        | final model  |
|---------------|---------------------------------------|------------|--------------|-----------------|-----------------|--------------|
| synchronous   | every step's vote                     | replicated | rank 0       | share of batch  | one step, all   | rank 0's     |
| periodic      | every round's vote (local steps wait) | replicated | rank 0       | own mean        | one round, all  | rank 0's     |
| server        | the server applied the push           | server     | the server   | share of batch  | the server says | the server's |
| decentralized | every step's exchanges                | average    | each member  | own mean        | each at its own | the average  |
| background    | every local step (rounds apart)       | none       | each member  | own mean        | each at its own | the average  |

A checkpoint holds what the final model would be plus what a resume needs: the committed state of
rank 0 (lockstep kinds; every member holds the same one at a commit point), the server's state,
or, for the kinds whose replicas differ, their average (a resume starts every member from it, with
fresh local optimizer state).

Entry `replicated`: the members exchange their newest committed state's (step, checksum); the
lowest-ranked holder of the newest broadcasts it, and every member that differs loads it.
`average`: nobody's live replica is overwritten: the members gather (holds state, step, newest exchange
launched and applied); each undoes the terms of split exchanges (see algorithms/policies/gossip.py); a member that
never held state (a joiner, or every member but one on a resume) loads the state of the lowest-ranked
holder of the newest step; those behind skip ahead to the newest step, counting the samples they skip.
`server`: pull from the server. `none`: nothing to reconcile.
"""
from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import numpy as np
import torch

from algorithms.rules.kinds import Kind, KindTraits
from core.comm_api import CommError, Communicator

_REGISTRY: dict[str, type[Algorithm]] = {}


def to_device(host: torch.Tensor, device: Any) -> torch.Tensor:
    """A small host tensor on `device`: to a GPU from pinned memory, without blocking (from pageable
    memory the copy makes the host wait for the GPU's queued work); as it is elsewhere."""
    if device is None or torch.device(device).type != "cuda":
        return host if device is None else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class VoteDraft:
    """This member's side of a vote, filled in while the step (or round) runs."""

    loss: Any = 0.0
    """Its loss, weighted for the policy's kind (a share of the global batch, or its own mean): a
    float, or a 0-d tensor on the model's device, so that no step waits on the device to read it."""
    samples: int = 0
    newer_plan: bool = False
    """It has seen a plan newer than the one it runs: the members switch together after this vote."""
    extras: tuple = ()
    """The workload's step metrics (`loss` returned them beside the loss), in the order of their sorted
    names, each weighted as the loss is; floats or 0-d tensors, like `loss`. They ride after the three
    numbers above (the impl's `vote_extras` says how many)."""

    def tail(self, dtype: torch.dtype = torch.float64, device: Any = None) -> torch.Tensor:
        """(loss, samples, newer plan, *extras) as one tensor, built on `device` without reading the loss,
        and on a GPU without the host waiting for it (the counts go up from pinned memory)."""
        counts = [0.0, float(self.samples), 1.0 if self.newer_plan else 0.0] + [0.0] * len(self.extras)
        tail = to_device(torch.tensor(counts, dtype=dtype), device)
        for i, value in enumerate((self.loss, *self.extras)):
            tail[0 if i == 0 else 2 + i] = value.detach().reshape(()) if isinstance(value, torch.Tensor) else value
        return tail


@dataclass(frozen=True)
class StepVote:
    """The result of a vote: whether the step (or round) commits, and what the members reported."""

    commit: bool
    loss: Any
    """A float, or (a local vote) the member's 0-d loss tensor, read only when recorded."""
    samples: int
    newer_plan: bool = False
    communicated: bool = True
    """False for a step that did not communicate (it commits locally, provisionally for periodic
    kinds until the next round)."""
    extras: tuple = ()
    """The step metrics, as `VoteDraft.extras` orders them: summed over the members (floats), or (a
    local vote) the member's own, read only when recorded."""

    @classmethod
    def local(cls, draft: VoteDraft) -> StepVote:
        return cls(True, draft.loss, draft.samples, draft.newer_plan, communicated=False, extras=draft.extras)

    @classmethod
    def reduced(cls, tail: torch.Tensor) -> StepVote:
        """The vote from a SUM-reduced tail (see `VoteDraft.tail`)."""
        loss, samples, newer, *extras = tail.tolist()
        return cls(True, loss, int(round(samples)), newer > 0, extras=tuple(extras))


@dataclass(frozen=True)
class EpochInfo:
    """What a policy learns of a membership epoch when it begins."""

    rank: int
    world_size: int
    members: tuple[str, ...]
    global_batch: int
    membership_epoch: int = 0
    nodes: tuple[str, ...] = ()
    """Each member's node, in rank order (empty or "" where unknown)."""


def register(cls: type[Algorithm]) -> type[Algorithm]:
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    """Import every policy's module (the policy table's `module`), which registers its class; lazy, so
    importing this module stays cheap."""
    import importlib

    from core.schema import POLICIES

    for module in dict.fromkeys(row.module for row in POLICIES):
        importlib.import_module(module)


def known_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type[Algorithm]:
    _load_builtin()
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


class AlgorithmImpl:
    """No-op hooks; each policy overrides the few it needs."""

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.algorithm = algorithm
        self.config = algorithm.config
        self.model = model
        self.optimizer = optimizer
        self.comm: Communicator | None = None
        self.epoch: EpochInfo | None = None
        self.accumulating = False
        """Set by the worker during micro-steps before the last one of a step (gradient
        accumulation): gradients accumulate locally, and communication waits for the last."""
        self.vote_extras = 0
        """How many step metrics the workload's loss returns (the replica sets it): a vote that is
        reduced carries them after (loss, samples, newer plan), so every member's tail has this width."""
        self.on_gradients_ready: Callable[[], None] | None = None
        """Set by the worker: a policy whose backward also waits for the step's communication (BSP on
        torch's reducer) calls it once this member's own gradients are all computed, so the wait that
        follows counts as communication, not compute (hang detection, `scale_down: slowest`)."""

    @property
    def kind(self) -> Kind:
        return self.algorithm.kind

    @property
    def bytes_sent(self) -> int:
        return 0 if self.comm is None else self.comm.bytes_sent

    def on_membership(self, comm: Communicator | None, epoch: EpochInfo) -> None:
        self.comm = comm
        self.epoch = epoch

    def on_epoch_end(self, reason: str) -> None:
        """The membership epoch is over (aborted, or a new one begins): drop references to its group
        and abandon background work (never join a thread that may be stuck in a collective)."""

    def start_at(self, step: int) -> None:
        """The member switched to this policy mid-run at `step`, a commit point: its state now is the
        newest committed one, and nothing of the policy's own schedule is due at that step."""

    def detach(self) -> None:
        """The member switches to another policy mid-run (the online trial of `sync.auto`): release what
        `bind()` attached to the model (gradient hooks, a reducer); this implementation is not used again."""

    def step_samples(self, step: int) -> np.ndarray | None:
        """The sample ids of this step when the policy deals them (a server kind's lease), or None: the
        member trains its rank's share of the global sampler's batch. An empty array: nothing to train
        now (the server said wait, or finished); the worker's loop comes back."""
        return None

    def refit_vote(self) -> None:
        """`vote_extras` changed inside a membership epoch, at a step's first loss, before any collective
        of that step: what carries the vote is sized for it now (the next `on_membership` sizes it
        anyway). Nothing to do for a vote that is never reduced."""

    def begin_step(self, step: int, draft: VoteDraft) -> None:
        """A new step: gradients start from zero (BSP instead zeroes the bucket views they live in)."""
        self.optimizer.zero_grad(set_to_none=True)

    def before_forward(self, step: int) -> None:
        pass

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-step's backward (BSP on torch's reducer readies the reducer for the last one, and
        turns a failed collective inside backward into CommError)."""
        loss.backward()

    def end_backward(self, step: int) -> None:
        pass

    def comm_error(self, err: BaseException) -> CommError | None:
        """`err`, raised by the forward, as the group's CommError where the policy's own communication
        raised it (FSDP gathers the parameters in the forward), else None (the forward's own error)."""
        return None

    def reraise(self, err: BaseException) -> NoReturn:
        """Raise `err` again (it was caught around the model's forward, backward or evaluation): as the
        group's CommError where the policy's own communication raised it (`comm_error`), else as it is."""
        failure = None if isinstance(err, CommError) else self.comm_error(err)
        if failure is None:
            raise err
        raise failure from None

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        return StepVote.local(draft)

    def apply_update(self, step: int, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def sync_due(self, step: int, stop_at: int | None) -> bool:
        """Whether a round (periodic kinds) is due before the step after `step`."""
        return False

    def sync(self, step: int, draft: VoteDraft) -> StepVote | None:
        """A round (after `sync_due` said one is due): its vote once it merges, None while it is in flight."""
        raise NotImplementedError(f"{self.algorithm.name} has no rounds")

    def commit(self, step: int) -> None:
        pass

    def discard(self, step: int) -> None:
        pass

    def stop_requested(self) -> bool:
        """True once the policy says the job is done (a server kind: the server applied `max_steps`
        versions); the worker then stops."""
        return False

    def need_reset(self, step: int) -> bool:
        """True when the policy must re-run `on_membership` before `step` (a phase change)."""
        return False

    @property
    def commit_mark(self) -> int | None:
        """The step of the newest committed state when it is not the current step (a periodic
        policy between rounds); None when every step commits."""
        return None

    def committed_parameters(self) -> list[torch.Tensor] | None:
        """The parameters of the committed state when they are not the live ones (see `commit_mark`)."""
        return None

    def rewind(self) -> None:
        """Return the replica to its committed state (the live parameters become `committed_parameters`)."""

    def eval_parameters(self) -> torch.Tensor | None:
        """Flat parameters to evaluate instead of the live replica (a background kind: the replicas'
        newest average), or None."""
        return None

    def record_fields(self) -> dict:
        """What the policy adds to each history record of this member (a background kind: its rounds)."""
        return {}

    def close(self, finished: bool) -> None:
        """The member's run ended (`finished`: it reached its stop; else it left or failed): stop
        background work, flush notices."""

    def exchange_report(self) -> tuple[int, int, int, int]:
        """Entry `average`: (epoch, step) of the newest exchange this member launched, then of the newest
        it applied ((-1, -1) for none); the members gather these at every entry."""
        return (-1, -1, -1, -1)

    def reconcile(self, reports: dict[str, tuple[int, int, int, int]]) -> int:
        """Entry `average`: every live member's `exchange_report` by slot; undo what a split exchange
        left behind (algorithms/policies/gossip.py). Returns how many terms were undone."""
        return 0

    @property
    def replicas_agree_at_commit(self) -> bool:
        """Whether every member holds the same state at a commit point (the `replicated` entry then treats
        a difference at the same step as a split commit and spreads the newest holder's)."""
        return True

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Algorithm(KindTraits, ABC):
    """Settings of one policy; `bind()` makes the per-worker implementation. Its kind's answers
    (`entry`, `reporter`, `final_model`, ...) come from `algorithms/rules/kinds.py`."""

    name: ClassVar[str]
    kind: Kind  # as KindTraits declares it; each policy sets it in its class body
    impl: ClassVar[type[AlgorithmImpl]] = AlgorithmImpl

    def __init__(self, config: Any, compression: Any = None) -> None:
        self.config = config
        self.compression = compression
        """The job's `compression:` section (a codec for the policies that take one), or None."""

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> AlgorithmImpl:
        return self.impl(self, model, optimizer)
