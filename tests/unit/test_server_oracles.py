"""Server policies in one process, no Ray: n simulated members against one `ServerCore` (pull, forward
and backward on the ticket's samples with the loss weighted by n_i / B, push), in a deterministic
interleaving of ticks, compared with the plain single-process BSP reference of the policy oracles.

`Sim` is the harness the other server tests reuse: each member takes `cost` ticks per step (a 3x
straggler has cost 3); every tick, in rank order, an idle member tries to pull (its gradient is
computed at once, on the parameters it pulled) and a busy one whose ticks are spent pushes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from algorithms.server import Fence, Push, PushResult, ServerCore, shard_bounds
from core.schema import ASPConfig, OptimizerConfig, QuorumConfig, SSPConfig
from tests.unit.test_policy_oracles import ADAMW, SEED, SGD_M, flat, max_diff, reference_bsp, set_flat, start_model

STEPS = 20


@dataclass
class Member:
    slot: str
    cost: int = 1
    incarnation: int = 0
    pending: Optional[Push] = None
    left: int = 0
    clock: Optional[int] = None
    """The clock it works on: its ticket's while busy, the next one once it pushed."""


@dataclass
class Sim:
    core: ServerCore
    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    members: dict[str, Member] = field(default_factory=dict)
    epoch: int = 0
    pulls: list[tuple[str, int, dict[str, int]]] = field(default_factory=list)
    """(slot, clock pulled, every live member's clock then), at each successful pull."""
    results: list[PushResult] = field(default_factory=list)
    retry: bool = False
    """Send every push twice (a retry after a lost reply): it must be applied once."""

    def set_members(self, members: list[Member]) -> None:
        self.members = {m.slot: m for m in members}
        self.epoch += 1  # versions a departure completes are recorded with the pushes' (for applied_leases)
        self.results.append(PushResult("applied", self.core.version,
                                       self.core.set_members(self.epoch, [(m.slot, m.incarnation) for m in members])))
        for m in members:
            if m.clock is None:
                m.clock = self.core.clocks[m.slot]

    def fence(self, m: Member) -> Fence:
        return Fence(self.epoch, m.slot, m.incarnation, self.core.incarnation)

    def pull(self, m: Member) -> bool:
        pulled = self.core.pull(self.fence(m))
        if pulled.status != "ok":
            return False
        m.clock = pulled.clock
        self.pulls.append((m.slot, pulled.clock, {s: o.clock for s, o in self.members.items()}))
        set_flat(list(self.model.parameters()), self.core.parameters())
        index = torch.tensor([i for lease in pulled.ticket.leases for i in lease.ids])
        self.model.zero_grad()
        loss = F.cross_entropy(self.model(self.x[index]), self.y[index]) * len(index) / self.core.global_batch
        loss.backward()
        grad = flat(p.grad for p in self.model.parameters())
        m.pending = Push(Fence(self.epoch, m.slot, m.incarnation, pulled.server_incarnation),
                         pulled.ticket.lease_ids, pulled.version, grad, float(loss.detach()))
        m.left = m.cost
        return True

    def push(self, m: Member) -> PushResult:
        result = self.core.push(m.pending)
        self.results.append(result)
        if self.retry:
            self.results.append(self.core.push(m.pending))
        m.pending, m.clock = None, m.clock + 1
        return result

    def tick(self) -> None:
        for m in list(self.members.values()):
            if self.core.finished:
                return
            if m.pending is None and not self.pull(m):
                continue
            m.left -= 1
            if m.left == 0:
                self.push(m)

    def run(self, ticks: int = 10_000) -> None:
        for _ in range(ticks):
            if self.core.finished:
                return
            self.tick()

    def applied_leases(self):
        return [lease for r in self.results for u in r.updates for t in u.tickets for lease in t.leases]


def make_core(optimizer: dict, policy, global_batch: int, shards: int = 1, steps: Optional[int] = STEPS,
              n_samples: Optional[int] = None) -> tuple[ServerCore, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A server core over the oracles' model, dealing from the first `n_samples` samples (all by default)."""
    model, x, y = start_model()
    core = ServerCore(list(model.parameters()), OptimizerConfig(**optimizer), policy, n_samples=n_samples or len(x),
                      seed=SEED, global_batch=global_batch, shards=shards, max_steps=steps)
    return core, model, x, y


def simulate(optimizer: dict, policy, costs: list[int], global_batch: int, shards: int = 1,
             steps: Optional[int] = STEPS, n_samples: Optional[int] = None) -> Sim:
    core, model, x, y = make_core(optimizer, policy, global_batch, shards, steps, n_samples)
    sim = Sim(core, model, x, y)
    sim.set_members([Member(f"w{i}", cost) for i, cost in enumerate(costs)])
    return sim


def server_params(sim: Sim) -> list[torch.Tensor]:
    vector = sim.core.parameters()
    params = [p.detach().clone() for p in sim.model.parameters()]
    set_flat(params, vector)
    return params


# ------------------------------------------------------------------ the oracles
CASES = [(2, 32), (3, 50), (4, 64)]
"""(members, global batch); 3 members on 50 samples, which 3 does not divide."""
COSTS = [2, 1, 3, 1]
"""Ticks per step: pushes arrive out of rank order."""


@pytest.mark.parametrize("optimizer", [SGD_M, ADAMW], ids=["sgd_momentum", "adamw"])
@pytest.mark.parametrize("n,global_batch", CASES)
@pytest.mark.parametrize("policy", ["ssp_s0", "quorum_kn"])
def test_ssp_s0_and_quorum_kn_equal_bsp(policy, n, global_batch, optimizer):
    rule = SSPConfig(s=0) if policy == "ssp_s0" else QuorumConfig(k=n)
    sim = simulate(optimizer, rule, COSTS[:n], global_batch)
    sim.run()
    assert sim.core.version == STEPS and sim.core.staleness == {0: STEPS * n}
    diff = max_diff(server_params(sim), reference_bsp(optimizer, global_batch, STEPS))
    print(f"{policy} n={n} B={global_batch} {optimizer['name']}: max |server - bsp| = {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("policy", [SSPConfig(s=2), QuorumConfig(k=2), ASPConfig()], ids=["ssp2", "quorum2", "asp"])
@pytest.mark.parametrize("optimizer", [SGD_M, ADAMW], ids=["sgd_momentum", "adamw"])
def test_two_shards_equal_one_bit_for_bit(policy, optimizer):
    runs = []
    for shards in (1, 2, 3):
        sim = simulate(dict(optimizer, nesterov=True) if optimizer is SGD_M else optimizer, policy, [1, 3, 2], 50, shards)
        sim.run()
        runs.append(sim.core.parameters())
    assert len(shard_bounds(runs[0].numel(), 3)) == 3
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_shards_cut_at_aligned_offsets_and_cover_everything():
    for numel, shards in [(1210, 2), (1210, 3), (100, 4), (64, 2), (10, 3)]:
        bounds = shard_bounds(numel, shards)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a < b and a % 64 == 0 for a, b in bounds)
        assert all(b == c for (_, b), (c, _) in zip(bounds[:-1], bounds[1:]))


def test_asp_lone_push_is_a_full_mean_gradient_step():
    """ASP scales a push by B / n_i: one push on its share is one SGD step on that share's mean gradient."""
    sim = simulate({"name": "sgd", "lr": 0.1}, ASPConfig(), [1, 1, 1], 50, steps=1)
    before = [p.clone() for p in server_params(sim)]
    m = sim.members["w1"]
    sim.pull(m)
    ids = [i for lease in sim.core.leases.open[m.pending.lease_ids[0]].leases for i in lease.ids]
    result = sim.push(m)
    assert result.status == "applied" and result.version == 1 and len(ids) == 17
    model, x, y = start_model()
    F.cross_entropy(model(x[ids]), y[ids]).backward()
    expected = [b - 0.1 * p.grad for b, p in zip(before, model.parameters())]
    assert max_diff(server_params(sim), expected) < 1e-6
