"""Decentralized (gossip) policies: `dpsgd`, `dadam` and `choco`. Pure torch; the communicator is given.

With `compression.codec` (fp16, bf16, uint8), `dpsgd` and `dadam` send their parameters' payload and
mix their own exact x_i with the peers' decoded x_j. `choco` (CHOCO-SGD, `ChocoImpl` below) sends
compressed differences to public copies instead.

Each step every member i exchanges its whole parameter vector with the peers of its topology's row
(algorithms/rules/topologies.py), point to point: at the start of the step (`before_forward`) it sends
its flat x_i to every rank whose row holds it (`sends_to`) and posts a receive for every peer j of
its own row, so the exchange overlaps forward and backward. The gradient g_i is computed at the old
x_i, from member i's own mean loss. When the exchange has landed (`finish_step`) the update is

    x_i <- step(sum_j W_ij x_j, g_i)

where W is the topology's mixing matrix at that step and `step(x, g)` is the configured optimizer's
step from the mixed point x with gradient g, its state (momentum, Adam moments) local to the member.
With plain SGD (no momentum, no weight decay) this is D-PSGD's x_i <- sum_j W_ij x_j - lr g_i(x_i).

- `dpsgd`: any configured optimizer, under the rule above.
- `dadam`: decentralized Adam with accumulation, from "From promise to practice" (`DAdamImpl`;
  needs optimizer.name: adamw for lr, betas, eps and weight decay). Member i keeps folded moments
  M_i, V_i and the sum of its gradients since the last fold. Step t (from 1) with gradient g:
  m~ = M + (1 - b1) g, v~ = V + (1 - b2) g^2, c = ceil(t / k), and
  x_i <- x̄_i (1 - lr wd) - lr (m~ / (1 - b1^c)) / (sqrt(v~ / (1 - b2^c)) + eps), x̄_i = sum_j W_ij x_j;
  every k steps, with ḡ the mean of the window's gradients, M <- b1 (M + (1 - b1) ḡ) and
  V <- b2 (V + (1 - b2) ḡ^2). With k = 1 that is AdamW exactly. Moments never travel; only
  parameters are mixed.

The topology is rebuilt from (rank, world size) in every membership epoch (`on_membership`, which
also checks that its W is doubly stochastic) and asked for the step's row at every step, so the
time-varying ones follow the step count. A step commits when its exchanges land (kind
`decentralized`); a failed send or receive raises CommError from `finish_step` and the step is not
taken (the parameters are untouched until the exchange lands). Memory beyond the model and
optimizer: one flat copy of the parameters to send, one receive buffer per peer, and one kept
term per peer (below).

Elastic runs (kind `decentralized`, entry `average`: actors/training/entry.py). A membership epoch ends on
any failed exchange and on every new plan (the coordinator aborts the group; the members agree on
the newest step at the next entry, those behind skip ahead counting the skipped samples). An
exchange can split: one end's receive fails while the other end's succeeded, so one member applied
its W_ij (x_j - x_i) term and its peer did not apply the step at all, and the sum of the replicas
moves by that term. Each member therefore keeps, per peer, the term of the newest exchange it
applied with that peer (one flat vector per peer), and reports at every entry which exchange it
launched last and which it applied last. A member whose live peer launched an exchange that it did
not apply undoes its term of that exchange. For a symmetric W (every topology but `one_peer_exp`
and `aer` across nodes, at n > 2) the two ends' terms cancel pairwise, so the undo leaves the live replicas'
average exactly where it was before the split exchange; for the asymmetric ones the member that did
not apply also misses the terms it would have received, which only it could add and it lacks (its
receive failed), so a residual (W_ij - W_ji)(x_j - x_i) remains. The report is exchanged at entry,
not inside the next exchange, because a member whose exchange fails leaves its group and never
sends another one in it; in the next epoch its peers may differ.

Consensus distance: every `sync.consensus_every` steps (0: never) the members measure
(1/n) sum_i ||x_i - x̄||^2 of their parameters at the start of the step with two all-reduces on
the epoch's group (the flat parameters for x̄, then the scalar ||x_i - x̄||^2), counted in the
member's bytes sent; the next history record of each member carries it as `consensus` (with
`consensus_step`, the step whose parameters were measured).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algorithms.policies.base import Algorithm, AlgorithmImpl, EpochInfo, StepVote, VoteDraft, register
from algorithms.policies.compression import Codec, get_codec
from algorithms.policies.optim import weight_decay_of
from algorithms.rules.kinds import DECENTRALIZED
from algorithms.rules.topologies import Row, TopologyError, get_topology
from core.comm_api import Communicator


def consensus_distance(replicas) -> float:
    """(1/n) sum_i ||x_i - x̄||^2 over the rows x_i of an (n, d) array or tensor (x̄ their mean)."""
    x = np.asarray(replicas, dtype=np.float64)
    return float(((x - x.mean(axis=0)) ** 2).sum(axis=1).mean())


NEVER = (-1, -1)
"""(membership epoch, step) of an exchange a member never launched or applied."""


@dataclass
class _Exchange:
    """One step's exchange in flight: this member's row of W, what it sent and what it receives."""

    step: int
    row: Row
    mine: torch.Tensor
    received: dict[int, torch.Tensor]
    handles: list


class GossipImpl(AlgorithmImpl):
    trace: list[tuple[str, int]] | None = None
    """When a list, the exchange appends ("launch", step) and ("land", step): for tests."""
    undo_split: bool = True
    """Undo the terms of a split exchange at the next entry (tests switch it off to see the drift)."""

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.topology = get_topology(self.config.topology.kind, **self.config.topology.params())
        self.exchange: _Exchange | None = None
        self.mixed: torch.Tensor | None = None
        """sum_j W_ij x_j of the step whose exchange landed, until `apply_update` takes it."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._landed: _Exchange | None = None
        self.launched: tuple[int, int] = NEVER
        """(membership epoch, step) of the newest exchange this member launched."""
        self.applied: tuple[int, int] = NEVER
        """(membership epoch, step) of the newest exchange whose mix this member applied."""
        self.terms: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}
        """Per peer slot: the newest applied exchange with it and its term W_ij (x_j - x_i)."""
        self.undone = 0
        """Terms undone at entries (split exchanges), for history."""
        self._consensus: tuple[int, float] | None = None
        compression = algorithm.compression
        self.codec: Codec | None = None if compression is None or compression.codec == "none" \
            else get_codec(compression.codec)
        """`compression.codec`: what goes on the wire is its payload (dpsgd: of the parameters)."""
        self._send: torch.Tensor | None = None
        self._decoded: dict[int, torch.Tensor] = {}
        """Per peer rank: a reused float buffer its payload is decoded into."""

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """x as sent: itself without a codec, else its payload in a reused buffer."""
        if self.codec is None:
            return x
        if self._send is None or self._send.numel() != self.codec.payload_bytes(x.numel()):
            self._send = torch.empty(self.codec.payload_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        return self.codec.compress(x, out=self._send)

    def _decode(self, peer: int, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """A received message as floats (a reused buffer per peer with a codec)."""
        if self.codec is None:
            return payload
        out = self._decoded.get(peer)
        if out is None or out.numel() != numel:
            out = self._decoded[peer] = torch.empty(numel, dtype=torch.float32, device=payload.device)
        return self.codec.decompress(payload, numel, out=out).to(self.dtype)

    def on_membership(self, comm: Communicator | None, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        self.topology.check(epoch.world_size)
        self.exchange = self.mixed = self._landed = None

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(self.dtype) for p in self.params])

    def _set_flat(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, chunk in zip(self.params, flat.split([p.numel() for p in self.params])):
                p.copy_(chunk.view_as(p))

    # ------------------------------------------------------------------ the step
    def _opens_exchange(self, step: int) -> bool:
        """At the start of a step: measure the consensus distance when due; whether the step exchanges."""
        if self.comm is None:
            return False
        assert self.epoch is not None  # set with comm (on_membership)
        every = getattr(self.config, "consensus_every", 0)
        if every and step % every == 0:
            self._measure_consensus(step)
        return self.epoch.world_size > 1

    def before_forward(self, step: int) -> None:
        if not self._opens_exchange(step):
            return
        mine = self._flat()
        self.exchange = self._launch(step, mine, self._encode(mine))

    def _launch(self, step: int, mine: torch.Tensor, message: torch.Tensor) -> _Exchange:
        """Send `message` to every rank whose row holds this member; post a receive per peer of its row."""
        assert self.epoch is not None and self.comm is not None  # exchanges run inside a membership epoch, on its group
        rank, world = self.epoch.rank, self.epoch.world_size
        row = self.topology.peers(rank, world, step)
        received = {peer: torch.empty_like(message) for peer, _ in row if peer != rank}
        self.launched = (self.epoch.membership_epoch, step)
        # one operation (on NCCL one group of point-to-point calls: sent one by one, a ring deadlocks)
        handles = [self.comm.exchange([(message, dst) for dst in self.topology.sends_to(rank, world, step)],
                                      [(buf, src) for src, buf in received.items()])]
        if self.trace is not None:
            self.trace.append(("launch", step))
        return _Exchange(step, row, mine, received, handles)

    def _measure_consensus(self, step: int) -> None:
        """(1/n) sum_i ||x_i - x̄||^2 over the epoch's members: two all-reduces (a CommError fails the step)."""
        assert self.epoch is not None and self.comm is not None  # measured inside a membership epoch, on its group
        n = self.epoch.world_size
        if n == 1:
            self._consensus = (step, 0.0)
            return
        mine = self._flat()
        mean = mine.clone()
        self.comm.all_reduce(mean).wait()
        mean /= n
        spread = ((mine.double() - mean.double()) ** 2).sum().reshape(1)
        self.comm.all_reduce(spread).wait()
        self._consensus = (step, float(spread[0]) / n)

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        exchange, self.exchange = self.exchange, None
        # A newer plan is not switched to by a vote: no step of this kind is reduced over every member,
        # so the coordinator aborts the epoch on every new plan and the members meet at the next entry.
        if exchange is None:
            return StepVote(True, draft.loss, draft.samples, False, communicated=False, extras=draft.extras)
        for handle in exchange.handles:
            handle.wait()
        assert self.epoch is not None  # the exchange was launched in it
        rank, numel = self.epoch.rank, exchange.mine.numel()
        exchange.received = {peer: self._decode(peer, buf, numel) for peer, buf in exchange.received.items()}
        self.mixed = self._weighted_sum((weight, exchange.mine if peer == rank else exchange.received[peer])
                                        for peer, weight in exchange.row)
        self._landed = exchange
        if self.trace is not None:
            self.trace.append(("land", step))
        return StepVote(True, draft.loss, draft.samples, False, communicated=True, extras=draft.extras)

    def apply_update(self, step: int, lr: float) -> None:
        """The optimizer's step from the mixed parameters, with the gradient taken at the old ones."""
        mixed, self.mixed = self.mixed, None
        landed, self._landed = self._landed, None
        if mixed is not None:
            assert landed is not None and self.epoch is not None  # the mix came with the exchange that landed
            rank = self.epoch.rank
            self._keep_terms(landed.step, {peer: torch.sub(landed.received[peer], landed.mine).mul_(weight)
                                           for peer, weight in landed.row if peer != rank})
            self._set_flat(mixed)
        self._local_step(step, lr)

    def _local_step(self, step: int, lr: float) -> None:
        """The member's own optimizer step from the mixed point (the configured optimizer)."""
        super().apply_update(step, lr)

    def _scratch(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like `like`, reused from step to step. A fresh tensor of the model's size
        costs about 0.5 ms here in page faults when other large temporaries are alive; CHOCO's and
        D-PSGD's arithmetic written as expressions made 4.6 ms a step of them on one core."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty_like(like)
        return buf

    def _weighted_sum(self, pairs) -> torch.Tensor:
        """sum(weight * tensor) over `pairs` in their order, bit for bit, into a reused buffer (valid
        until the next call: the step consumes it)."""
        out = None
        for weight, tensor in pairs:
            if out is None:
                out = torch.mul(tensor, weight, out=self._scratch("sum", tensor))
            else:
                out.add_(torch.mul(tensor, weight, out=self._scratch("term", tensor)))
        assert out is not None  # never empty: a row holds the member itself
        return out

    def _keep_terms(self, step: int, terms: dict[int, torch.Tensor]) -> None:
        """The exchange of `step` is applied: keep each peer's mix term (by slot) for `reconcile`."""
        assert self.epoch is not None  # the exchange was applied in it
        when = (self.epoch.membership_epoch, step)
        for peer, term in terms.items():
            self.terms[self.epoch.members[peer]] = (when, term)
        self.applied = when

    def discard(self, step: int) -> None:
        self.exchange = self.mixed = self._landed = None

    def on_epoch_end(self, reason: str) -> None:
        self.exchange = self.mixed = self._landed = None  # its buffers are abandoned with the group

    def record_fields(self) -> dict:
        out: dict[str, Any] = {}
        if self._consensus is not None:
            (at, value), self._consensus = self._consensus, None
            out.update(consensus=value, consensus_step=at)
        if self.undone:
            out["undone_terms"], self.undone = self.undone, 0
        return out

    # ------------------------------------------------------------------ entry
    def exchange_report(self) -> tuple[int, int, int, int]:
        """(epoch, step) of the newest exchange launched, then of the newest applied."""
        return (*self.launched, *self.applied)

    def reconcile(self, reports: dict[str, tuple[int, int, int, int]]) -> int:
        """At an entry, with every live member's `exchange_report` by slot: undo each kept term whose
        peer launched that very exchange as its newest and did not apply it (a split exchange).
        Peers that left or were replaced (a fresh replica launched nothing) keep their terms: the
        replica they mixed with is gone. Returns how many terms were undone; all are dropped."""
        undo = []
        for slot, (when, term) in self.terms.items():
            report = reports.get(slot)
            if report is not None and tuple(report[:2]) == when and tuple(report[2:]) != when:
                undo.append(term)
        if undo and self.undo_split:
            self._set_flat(self._flat() - sum(undo))
            self.undone += len(undo)
        self.terms = {}
        return len(undo) if self.undo_split else 0


@register
class DPSGD(Algorithm):
    """D-PSGD: mix parameters with the topology's peers, overlapped with the local gradient."""

    name = "dpsgd"
    kind = DECENTRALIZED
    impl = GossipImpl


class DAdamImpl(GossipImpl):
    """`dadam`: the gossip step with Adam-with-accumulation as the local step (see the module's doc).
    Its state (t, M, V, the window's gradient sum) is the algorithm state a joiner and a checkpoint
    carry; the configured AdamW only supplies the hyperparameters (its own state stays empty)."""

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        group = optimizer.param_groups[0]
        self.betas, self.eps = group["betas"], group["eps"]
        self.k = int(self.config.k)
        self.t = 0
        dim = sum(p.numel() for p in self.params)
        self.wd = torch.cat([torch.full((p.numel(),), decay, dtype=self.dtype) for p, decay in
                             zip(self.params, weight_decay_of(optimizer, self.params))]) if dim else torch.zeros(0)
        """Each element's weight decay, from its parameter's group (the no-decay groups)."""
        self.m = torch.zeros(dim, dtype=self.dtype)
        self.v = torch.zeros(dim, dtype=self.dtype)
        self.window = torch.zeros(dim, dtype=self.dtype)

    def _local_step(self, step: int, lr: float) -> None:
        b1, b2 = self.betas
        g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(self.dtype)
                       for p in self.params])
        self.t += 1
        c = -(-self.t // self.k)  # ceil(t / k)
        m_t = self.m + (1 - b1) * g
        v_t = self.v + (1 - b2) * g * g
        x = self._flat()
        new = x * (1 - lr * self.wd) - lr * (m_t / (1 - b1 ** c)) / ((v_t / (1 - b2 ** c)).sqrt() + self.eps)
        self._set_flat(new)
        self.window += g
        if self.t % self.k == 0:
            mean = self.window / self.k
            self.m = b1 * (self.m + (1 - b1) * mean)
            self.v = b2 * (self.v + (1 - b2) * mean * mean)
            self.window.zero_()
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # what history records as the step's LR

    def state_dict(self) -> dict:
        return {"t": self.t, "m": self.m.clone(), "v": self.v.clone(), "window": self.window.clone()}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.t = int(state["t"])
        self.m, self.v, self.window = (state[key].to(self.dtype).clone() for key in ("m", "v", "window"))


@register
class DAdam(DPSGD):
    """Decentralized Adam with accumulation: `dpsgd` whose local step is Adam on moments folded every
    `k` steps (`DAdamImpl`)."""

    name = "dadam"
    impl = DAdamImpl


class ChocoImpl(GossipImpl):
    """CHOCO-SGD: gossip of compressed differences to public copies (see `ChocoConfig`).

    Step t of a member, once its membership epoch has had one step:
    1. `before_forward`: q_i = Q(x_i - x̂_i) of its committed parameters x_i (the point the previous
       step's optimizer reached), sent to every rank whose row holds it; the q_j of its peers are
       received (no overlap: the forward pass needs the mixed point). Every copy it holds moves,
       x̂_j += q_j (x̂_i too, by its own decoded q_i), and x_i <- x_i + gamma_c sum_j W_ij (x̂_j - x̂_i).
    2. forward and backward at that point; `apply_update`: the configured optimizer's step.
    So each step is CHOCO's "gossip, then gradient step", and over a run it is CHOCO's iteration
    (gradient step; gossip) shifted by half a step: its committed state is the point before the
    gossip. The first step of every membership epoch has nothing to gossip yet (its public copies
    are zero, re-initialized at entry) and is a plain local step.

    A failed exchange fails the step before anything moved. A step that exchanged and is then
    discarded puts x_i back and takes every q_j off again. Each member keeps, per peer, the term
    gamma_c W_ij (x̂_j - x̂_i) of its newest applied exchange for the entry's undo of split exchanges
    (as `dpsgd`; for a symmetric W the two ends' terms cancel, since both ends hold the same copies).
    Memory beyond the model and optimizer: a public copy per row member, a decoded q per row member
    (kept for a discard), one copy of x_i, the difference, the receive buffers and a term per peer.
    The copies, the decoded q's and the send payload are reused; the rest is allocated each step."""

    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(algorithm, model, optimizer)
        self.gamma = float(self.config.consensus_lr)
        self.public: dict[int, torch.Tensor] = {}
        """x̂_j per rank j of this member's row (itself included), of the current membership epoch."""
        self._q: dict[int, torch.Tensor] = {}
        self._backup: torch.Tensor | None = None
        """x_i before this step's gossip moved it, until the step commits or is discarded (None: not moved)."""
        self._terms: dict[int, torch.Tensor] = {}
        self._due = False

    def on_membership(self, comm: Communicator | None, epoch: EpochInfo) -> None:
        super().on_membership(comm, epoch)
        if self.topology.period(epoch.world_size) != 1 or self.config.topology.kind == "matching":
            raise TopologyError(f"choco needs a static topology, not {self.config.topology.kind!r}")
        self.public, self._q = {}, {}  # re-initialized at every entry: every holder starts from zero
        self._backup, self._due = None, False

    def before_forward(self, step: int) -> None:
        if not self._opens_exchange(step) or not self._due:
            return
        assert self.epoch is not None  # the exchange opens in it
        rank = self.epoch.rank
        x = self._flat()
        numel = x.numel()
        for peer, _ in self.topology.peers(rank, self.epoch.world_size, step):
            if peer not in self.public:
                self.public[peer] = torch.zeros(numel, dtype=self.dtype, device=x.device)
        diff = torch.sub(x, self.public[rank], out=self._scratch("diff", x))
        message = self._encode(diff)
        exchange = self._launch(step, x, message)
        for handle in exchange.handles:  # before any copy moves: a failure leaves everything as it was
            handle.wait()
        self._q = {rank: self._decode(rank, message, numel)}  # what its holders add: the decoded q_i
        for peer, buf in exchange.received.items():
            self._q[peer] = self._decode(peer, buf, numel)
        for peer, q in self._q.items():
            self.public[peer] += q
        own = self.public[rank]
        terms = {peer: torch.sub(self.public[peer], own).mul_(self.gamma * weight)
                 for peer, weight in exchange.row if peer != rank}
        self._backup = x
        self._set_flat(self._weighted_sum([(1.0, term) for term in terms.values()]).add_(x) if terms else x)
        self.exchange = exchange
        self._terms = terms

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        exchange, self.exchange = self.exchange, None
        if self.trace is not None and exchange is not None:
            self.trace.append(("land", step))
        return StepVote(True, draft.loss, draft.samples, False, communicated=exchange is not None,
                        extras=draft.extras)

    def apply_update(self, step: int, lr: float) -> None:
        if self._backup is not None:
            self._keep_terms(step, self._terms)
            self._backup, self._terms = None, {}
        AlgorithmImpl.apply_update(self, step, lr)
        self._due = True

    def _take_back(self) -> None:
        if self._backup is not None:
            for peer, q in self._q.items():
                self.public[peer] -= q
            self._set_flat(self._backup)
            self._backup, self._terms = None, {}

    def discard(self, step: int) -> None:
        super().discard(step)
        self._take_back()

    def on_epoch_end(self, reason: str) -> None:
        super().on_epoch_end(reason)
        self._take_back()


@register
class Choco(DPSGD):
    """CHOCO-SGD: low-precision decentralized SGD with public copies (compressed differences)."""

    name = "choco"
    impl = ChocoImpl
