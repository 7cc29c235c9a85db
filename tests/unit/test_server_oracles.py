"""Server policies in one process, no Ray: n simulated members against one `ServerCore` (pull, forward
and backward on the ticket's samples with the loss weighted by n_i / B, push), in a deterministic
interleaving of ticks, compared with the plain single-process BSP reference of the policy oracles.

`Sim` is the harness the other server tests reuse: each member takes `cost` ticks per step (a 3x
straggler has cost 3); every tick, in rank order, an idle member tries to pull (its gradient is
computed at once, on the parameters it pulled) and a busy one whose ticks are spent pushes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from algorithms.policies.server import ServerCore
from algorithms.policies.server_messages import Fence, Push, PushResult
from algorithms.policies.server_shards import shard_bounds
from core.schema import ASPConfig, OptimizerConfig, QuorumConfig, SSPConfig
from tests.unit.test_policy_oracles import ADAMW, SEED, SGD_M, flat, max_diff, reference_bsp, set_flat, start_model

STEPS = 20


@dataclass
class Member:
    slot: str
    cost: int = 1
    incarnation: int = 0
    pending: Push | None = None
    left: int = 0
    clock: int | None = None
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
    samples: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    """(slot, clock) -> the sample ids of the ticket pulled for it."""
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
        self.samples[(m.slot, pulled.clock)] = index.tolist()
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


def make_core(optimizer: dict, policy, global_batch: int, shards: int = 1, steps: int | None = STEPS,
              n_samples: int | None = None) -> tuple[ServerCore, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A server core over the oracles' model, dealing from the first `n_samples` samples (all by default)."""
    model, x, y = start_model()
    core = ServerCore(list(model.parameters()), OptimizerConfig(**optimizer), policy, n_samples=n_samples or len(x),
                      seed=SEED, global_batch=global_batch, shards=shards, max_steps=steps)
    return core, model, x, y


def simulate(optimizer: dict, policy, costs: list[int], global_batch: int, shards: int = 1,
             steps: int | None = STEPS, n_samples: int | None = None) -> Sim:
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


# ------------------------------------------------------------------ ssp s > 0 and quorum k < n, by value
def reference_clocked(rule: str, bound: int, costs: list[int], samples: dict, global_batch: int, steps: int,
                      lr: float, momentum: float) -> tuple[torch.Tensor, dict[int, int], int]:
    """SSP(s) and quorum(k) written from their rules, in the harness's tick order (each tick, in rank
    order: an idle member starts its clock if allowed, on the parameters of that moment; a member whose
    ticks are spent pushes). The data a member trains for a clock is an input (the dispenser's business,
    tested on its own). Returns the final flat parameters, the staleness histogram and the drops.

    - ssp: a member may start clock c once the applied version >= c - s; clock c is applied once every
      member pushed it.
    - quorum: a member starts at the next clock to apply when it fell behind (version > its clock),
      and only once version >= c; clock c is applied once k members pushed it; a push for a clock
      already applied is dropped.
    - apply: one SGD-with-momentum step on the sum of the clock's pushes (each the gradient of the sum
      of its samples' losses / B), scaled by B / (samples pushed): buf = momentum * buf + g,
      w = w - lr * buf; the version is the number of applied clocks.
    """
    model, x, y = start_model()
    w = flat(model.parameters()).clone()
    buf = torch.zeros_like(w)
    n = len(costs)
    version, drops = 0, 0
    clock = [0] * n
    busy: list[list | None] = [None] * n  # [clock, gradient, samples, version pulled, ticks left]
    staged: dict[int, dict[int, tuple[torch.Tensor, int, int]]] = {}
    staleness: dict[int, int] = {}

    def gradient(rank: int, c: int) -> tuple[torch.Tensor, int]:
        ids = torch.tensor(samples[(f"w{rank}", c)])
        set_flat(list(model.parameters()), w)
        model.zero_grad()
        (F.cross_entropy(model(x[ids]), y[ids], reduction="sum") / global_batch).backward()
        return flat(p.grad for p in model.parameters()).clone(), len(ids)

    while version < steps:
        for r in range(n):
            if version >= steps:
                break
            if busy[r] is None:
                if rule == "quorum" and clock[r] < version:
                    clock[r] = version
                allowed = version >= clock[r] - (bound if rule == "ssp" else 0)
                if not allowed:
                    continue
                g, count = gradient(r, clock[r])
                busy[r] = [clock[r], g, count, version, costs[r]]
            busy[r][4] -= 1
            if busy[r][4]:
                continue
            c, g, count, pulled, _ = busy[r]
            busy[r], clock[r] = None, c + 1
            if c < version:  # quorum: applied without it
                drops += 1
                continue
            staged.setdefault(c, {})[r] = (g, count, pulled)
            need = n if rule == "ssp" else bound
            while len(staged.get(version, {})) >= need and version < steps:
                pushes = [staged[version][k] for k in sorted(staged[version])]
                total = torch.stack([p[0] for p in pushes]).sum(0) * global_batch / sum(p[1] for p in pushes)
                buf = momentum * buf + total
                w = w - lr * buf
                for p in pushes:  # version at apply minus version pulled
                    staleness[version - p[2]] = staleness.get(version - p[2], 0) + 1
                del staged[version]
                version += 1
    return w, staleness, drops


SGD_PLAIN_M = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


@pytest.mark.parametrize("rule,bound,costs", [("ssp", 2, [1, 3, 1]), ("ssp", 1, [2, 1, 3, 1]),
                                              ("quorum", 2, [1, 3, 1]), ("quorum", 3, [2, 1, 4, 1])])
def test_ssp_with_slack_and_quorum_below_n_equal_their_rules_by_value(rule, bound, costs):
    """Stragglers make the slack and the quorum matter: some pushes are stale, some dropped."""
    global_batch = 48
    policy = SSPConfig(s=bound) if rule == "ssp" else QuorumConfig(k=bound)
    sim = simulate(SGD_PLAIN_M, policy, costs, global_batch)
    sim.run()
    assert sim.core.version == STEPS
    want, staleness, drops = reference_clocked(rule, bound, costs, sim.samples, global_batch, STEPS,
                                               SGD_PLAIN_M["lr"], SGD_PLAIN_M["momentum"])
    diff = float((sim.core.parameters() - want).abs().max())
    dropped = sum(1 for r in sim.results if r.status == "dropped")
    print(f"{rule} {bound} costs {costs}: max |server - rule| = {diff:.2e}; staleness {staleness}; drops {drops}")
    if rule == "ssp":
        assert any(k > 0 for k in staleness), "the case must exercise stale pushes"
    else:
        assert drops > 0 and set(staleness) == {0}, "quorum drops late pushes; what it applies is never stale"
    assert sim.core.staleness == staleness and dropped == drops
    assert diff < 1e-6
