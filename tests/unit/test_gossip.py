"""Gossip policies in process, without Ray: `dpsgd` (and `dadam`) run by real replicas (the worker's
step loop) in threads over in-process gloo, against a plain-torch simulation of the n replicas that
mixes with the literal W of algorithms/rules/topologies.py; the consensus distance contracts as W says; the
exchange is launched before the forward pass."""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.transport.comm import CommError
from algorithms.policies import base
from algorithms.policies.base import EpochInfo
from algorithms.policies.gossip import DPSGD, DAdam, consensus_distance
from algorithms.rules.kinds import DECENTRALIZED
from algorithms.rules.topologies import TOPOLOGIES, contraction, get_topology
from core import schema
from core.schema import ConfigError, DPSGDConfig, parse
from testkit.harness import LocalJob, drive_step, local_group, wait_until
from tests.unit.test_policy_oracles import SEED, config, flat, global_batch_ids, make_opt, max_diff, set_flat, share, start_model

STEPS = 10
SGD = {"name": "sgd", "lr": 0.1}


@pytest.fixture
def wired():
    """The gossip policies are registered and let through the schema (they run as jobs)."""
    assert {"dpsgd", "dadam"} <= set(base.known_policies()) and not schema.NOT_WIRED & {"dpsgd", "dadam"}


def run_gossip(tmp_path, sync: dict, optimizer: dict, n: int, global_batch: int, trace: list | None = None):
    """Every replica's parameters after STEPS steps of `sync`, run by n real replicas in process."""
    slots = [f"w{i}" for i in range(n)]
    job = LocalJob(config(sync, optimizer, STEPS, n), slots, str(tmp_path))
    if trace is not None:
        job.replicas["w0"].policy.impl.trace = trace
        job.replicas["w0"].training.model.register_forward_hook(lambda *_: trace.append(("forward", -1)))
    job.run(tuple(slots), global_batch)
    return [job.parameters(s) for s in slots]


def literal_w(kind: str, n: int, step: int) -> torch.Tensor:
    """The mixing matrix from the topologies' definitions, written here (not taken from
    algorithms/rules/topologies.py): `ring`, self and both neighbours at 1/3 (n >= 3); `one_peer_exp`, rank i
    averages with (i + 2^(t mod ceil(log2 n))) mod n at 1/2."""
    import math

    w = torch.zeros(n, n)
    for i in range(n):
        if kind == "ring":
            for j in (i - 1, i, i + 1):
                w[i, j % n] += 1.0 / 3.0
        elif kind == "one_peer_exp":
            peer = (i + 2 ** (step % math.ceil(math.log2(n)))) % n
            w[i, i] += 0.5
            w[i, peer] += 0.5
        else:
            raise ValueError(kind)
    return w


def reference_gossip(kind: str, optimizer: dict, n: int, global_batch: int) -> list[list[torch.Tensor]]:
    """n replicas in one process: each takes the gradient of its own mean loss on its share at its own
    x_i, then X <- W_t X (W_t the literal matrix of step t) and the optimizer steps from there."""
    model, x, y = start_model()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    opts = [make_opt(m.parameters(), optimizer) for m in replicas]
    for step in range(STEPS):
        ids = global_batch_ids(step, global_batch, len(x))
        for i, (m, opt) in enumerate(zip(replicas, opts)):
            index = torch.tensor(share(ids, i, n))
            opt.zero_grad()
            F.cross_entropy(m(x[index]), y[index]).backward()
        mixed = literal_w(kind, n, step) @ torch.stack([flat(m.parameters()) for m in replicas])
        for m, opt, row in zip(replicas, opts, mixed):
            set_flat(list(m.parameters()), row)
            opt.step()
    return [[p.detach() for p in m.parameters()] for m in replicas]


@pytest.mark.parametrize("kind", ["ring", "one_peer_exp"])
@pytest.mark.parametrize("n,global_batch", [(4, 64), (5, 50)])
def test_dpsgd_equals_n_replica_simulation_with_literal_w(tmp_path, wired, kind, n, global_batch):
    mine = run_gossip(tmp_path, {"policy": "dpsgd", "topology": {"kind": kind}}, SGD, n, global_batch)
    ref = reference_gossip(kind, SGD, n, global_batch)
    diff = max(max_diff(a, b) for a, b in zip(mine, ref))
    spread = max(max_diff(mine[0], other) for other in mine[1:])
    print(f"dpsgd {kind} n={n}: {diff:.2e} (replicas still {spread:.2e} apart)")
    assert diff < 1e-5
    assert spread > 1e-4, "the replicas differ: a test that would pass for an exact all-reduce proves nothing"


def test_dadam_k1_equals_n_replica_simulation_with_local_adamw(tmp_path, wired):
    adamw = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "no_decay": []}  # every weight decays, as the reference
    mine = run_gossip(tmp_path, {"policy": "dadam", "k": 1, "topology": {"kind": "ring"}}, adamw, 4, 64)
    diff = max(max_diff(a, b) for a, b in zip(mine, reference_gossip("ring", adamw, 4, 64)))
    print(f"dadam ring n=4: {diff:.2e}")
    assert diff < 1e-5


def test_exchange_launches_before_the_forward_pass_and_lands_after_backward(tmp_path, wired):
    trace: list = []
    run_gossip(tmp_path, {"policy": "dpsgd"}, SGD, 3, 24, trace=trace)
    events = [kind for kind, _ in trace]
    assert events[:3 * STEPS] == ["launch", "forward", "land"] * STEPS, events
    assert set(events[3 * STEPS:]) <= {"forward"}, "after the last step, only the final evaluation's forward"
    assert [step for kind, step in trace if kind != "forward"] == [s for s in range(STEPS) for _ in (0, 1)]


# ------------------------------------------------------------------ consensus
def one_exchange(replicas: list[torch.nn.Module], kind: str, step: int) -> None:
    """One step of `dpsgd` at lr 0 by every replica over a real gloo group in threads (hooks driven here)."""
    n = len(replicas)
    comms = local_group(n, name=f"gossip-{kind}-{n}")
    algo = DPSGD(DPSGDConfig(topology=parse(schema.TopologyConfig, {"kind": kind})))

    def member(rank: int) -> None:
        model = replicas[rank]
        impl = algo.bind(model, torch.optim.SGD(model.parameters(), lr=0.0))
        impl.on_membership(comms[rank], EpochInfo(rank, n, tuple(f"w{i}" for i in range(n)), 8 * n))
        drive_step(impl, model, step, torch.randn(8, 64), samples=8, lr=0.0)

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(member, range(n)))


@pytest.mark.parametrize("kind,step", [("ring", 0), ("one_peer_exp", 1), ("torus", 0), ("matching", 3)])
def test_consensus_distance_contracts_as_w_predicts(kind, step):
    n = 6
    torch.manual_seed(SEED)
    replicas = [torch.nn.Linear(64, 10) for _ in range(n)]  # independently initialized: far apart
    before = torch.stack([flat(m.parameters()) for m in replicas]).double()
    w = get_topology(kind).matrix(n, step)
    one_exchange(replicas, kind, step)
    after = torch.stack([flat(m.parameters()) for m in replicas]).double()
    d0, d1 = consensus_distance(before), consensus_distance(after)
    print(f"{kind} step {step}: consensus {d0:.4g} -> {d1:.4g} (W predicts {consensus_distance(w @ before.numpy()):.4g})")
    assert d1 == pytest.approx(consensus_distance(w @ before.numpy()), rel=1e-5)
    assert d1 <= contraction(w) ** 2 * d0 * (1 + 1e-6) and d1 < d0
    assert torch.allclose(after.mean(0), before.mean(0), atol=1e-6), "a doubly stochastic W keeps the average"


def test_consensus_distance_is_the_mean_squared_distance_to_the_average():
    x = np.array([[0.0, 0.0], [2.0, 0.0], [1.0, 3.0]])
    assert consensus_distance(x) == pytest.approx((2 + 2 + 4) / 3)  # mean (1, 1)
    assert consensus_distance(torch.ones(4, 3)) == 0.0


# ------------------------------------------------------------------ config
def test_topology_kinds_are_the_topologies_module_s():
    assert set(schema.TOPOLOGY_KINDS) == set(TOPOLOGIES)


def test_unknown_topology_is_refused_listing_the_valid_ones():
    with pytest.raises(ConfigError, match=r"sync.topology.kind: unknown topology 'star'; valid kinds: aer, complete"):
        parse(DPSGDConfig, {"policy": "dpsgd", "topology": {"kind": "star"}}, "sync")


@pytest.mark.parametrize("policy", ["dpsgd", "dadam"])
def test_a_job_naming_a_gossip_policy_is_accepted_and_runs_its_registered_class(policy):
    from orchestrator.config import config_from_dict
    cfg = config_from_dict({"name": "m", "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                            "optimizer": {"name": "adamw"}, "sync": {"policy": policy, "consensus_every": 5}})
    assert cfg.sync.policy == policy and cfg.sync.consensus_every == 5
    assert base.get_algorithm(policy) is {"dpsgd": DPSGD, "dadam": DAdam}[policy]
    assert base.get_algorithm(policy).kind is DECENTRALIZED


def test_consensus_every_must_not_be_negative():
    with pytest.raises(ConfigError, match="consensus_every"):
        parse(DPSGDConfig, {"policy": "dpsgd", "consensus_every": -1}, "sync")


# ------------------------------------------------------------------ split exchanges
class _FailingRecv:
    """A member's communicator whose exchange that receives from rank `src` at step `step` of epoch 1
    lands (so the sender's exchange completes) and then reports a failure: one end fails, the other
    succeeds."""

    def __init__(self, inner, replica, src: int, step: int) -> None:
        self._inner, self._replica, self._src, self._step = inner, replica, src, step

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def exchange(self, sends, recvs):
        handle = self._inner.exchange(sends, recvs)
        src = self._src
        if (all(peer != src for _, peer in recvs) or self._replica.training.step != self._step
                or self._replica.plan.membership_epoch != 1):
            return handle
        slot = self._replica.slot

        class Failing:
            def wait(self, timeout=None):
                handle.wait(timeout)
                raise CommError(f"injected: {slot}'s receive from rank {src} failed")

        return Failing()


def _replica_average(job, slots) -> torch.Tensor:
    return torch.stack([flat(job.parameters(s)).double() for s in slots]).mean(0)


def run_through_split(tmp_path, monkeypatch, fault: str, undo: bool, kind: str = "ring", n: int = 4,
                      policy: str = "dpsgd", codec: str = "none"):
    """n perturbed replicas at lr 0 (only mixing moves them); w1's exchange of step 3 splits (its
    receive from rank 0 fails after landing, or it loses the step's result), the test re-plans and
    aborts the epoch as the coordinator does, and the job runs to the end. Returns (average before,
    average after, the records)."""
    import actors.training.step as step_module
    from algorithms.policies.gossip import GossipImpl

    monkeypatch.setattr(step_module, "lr_at", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(GossipImpl, "undo_split", undo)
    slots = [f"w{i}" for i in range(n)]
    cfg = config({"policy": policy, "topology": {"kind": kind}, "consensus_every": 0}, SGD, 12, n)
    cfg["compression"] = {"codec": codec}
    if fault == "vote":
        cfg["faults"] = {"kills": [{"slot": "w1", "at": "vote", "step": 3}]}
    job = LocalJob(cfg, slots, str(tmp_path), timeout_s=10.0)
    if fault == "recv":
        w1 = job.replicas["w1"]
        w1.faults.wrap = lambda comm, step: _FailingRecv(comm, w1, src=0, step=3)
    gen = torch.Generator().manual_seed(7)
    for slot in slots:
        with torch.no_grad():
            for p in job.replicas[slot].training.model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    before = _replica_average(job, slots)
    job.publish(tuple(slots), 1, 8 * n)
    job.start()
    wait_until(lambda: any(name == "collective_failed" for name, _ in job.link.calls), 30, "w1's failed exchange")
    # w1's peers of step 3 applied it (with w1's term) before the epoch is aborted: the split is real
    peers = [f"w{j}" for j in get_topology(kind).sends_to(1, n, 3)]
    wait_until(lambda: all(job.replicas[p].training.step >= 4 for p in peers), 30, f"{peers} past step 3")
    job.publish(tuple(slots), 2, 8 * n)
    for replica in job.replicas.values():
        replica.abort_epoch(1, "test: a new plan")
    try:
        outcomes = job.wait(60)
    except TimeoutError:
        raise AssertionError({s: (r.training.step, r.phase, r.plan.membership_epoch, r.state, r.cause)
                              for s, r in job.replicas.items()}) from None
    assert all(o.ok for o in outcomes.values()), outcomes
    assert {o.step for o in outcomes.values()} == {12}
    return before, _replica_average(job, slots), job.link.records


@pytest.mark.parametrize("fault", ["recv", "vote"])
def test_a_split_exchange_leaves_the_live_replicas_average_unchanged(tmp_path, monkeypatch, fault):
    before, after, records = run_through_split(tmp_path, monkeypatch, fault, undo=True)
    undone = sum(r.get("undone_terms", 0) for r in records)
    drift = float((after - before).abs().max())
    print(f"split by {fault}: {undone} terms undone, the average moved {drift:.2e}")
    assert undone >= 1, "the fault split an exchange and the entry undid its terms"
    assert drift <= 1e-6


def test_without_the_undo_a_split_exchange_moves_the_average(tmp_path, monkeypatch):
    """The same run with the undo switched off: the test above would fail (the average moves)."""
    before, after, records = run_through_split(tmp_path, monkeypatch, "recv", undo=False)
    drift = float((after - before).abs().max())
    print(f"split without the undo: the average moved {drift:.2e}")
    assert drift > 1e-4


def test_a_joiner_starts_from_the_newest_live_replica_and_no_sample_is_applied_twice(tmp_path):
    """w0..w2 train; w3 joins (a new plan, the old epoch aborted as the coordinator does): it loads the
    state of the lowest-ranked member at the newest step instead of training from the initial
    weights; the members behind skip ahead and count what they skip; every member ends at its stop."""
    steps = 30
    slots = ["w0", "w1", "w2", "w3"]
    cfg = config({"policy": "dpsgd", "topology": {"kind": "ring"}, "consensus_every": 4}, SGD, steps, 4)
    cfg["faults"] = {"record_samples": True,  # 20 ms steps: the join lands well before the others finish
                     "stragglers": [{"slot": s, "delay_s": 0.02} for s in slots]}
    job = LocalJob(cfg, slots, str(tmp_path), timeout_s=10.0)
    job.publish(("w0", "w1", "w2"), 1, 24)
    job.start(["w0", "w1", "w2"])
    wait_until(lambda: any(r["step"] >= 6 for r in job.link.records), 30, "six steps")
    job.publish(tuple(slots), 2, 32)
    for replica in job.replicas.values():
        replica.abort_epoch(1, "test: w3 joins")
    job.start(["w3"])
    try:
        outcomes = job.wait(60)
    except TimeoutError:
        raise AssertionError({s: (r.training.step, r.phase, r.plan.membership_epoch, r.state, r.cause)
                              for s, r in job.replicas.items()}) from None
    assert all(o.ok and o.step == steps for o in outcomes.values()), outcomes
    received = [args for name, args in job.link.calls if name == "state_received"]
    assert [a[0] for a in received] == ["w3"] and received[0][2] in ("w0", "w1", "w2") and received[0][3] >= 6, received
    w3 = [r["step"] for r in job.link.records if r["slot"] == "w3"]
    assert w3[0] > 6, "the joiner starts at the newest step, not from 0"
    consensus = [r for r in job.link.records if "consensus" in r]
    assert consensus and any(r["consensus"] > 0 for r in consensus), "the replicas of a ring differ"
    ids = []
    for slot in slots:
        lines = (tmp_path / "samples" / f"{slot}.txt").read_text().splitlines()
        ids += [int(i) for line in lines for i in line.split()[2:]]
    assert len(ids) == len(set(ids)), "a sample was applied twice within the data epoch"


def test_status_prints_the_topology_and_its_spectral_gap():
    from algorithms.rules.topologies import spectral_gap
    from core.schema import JobStatus
    from orchestrator.cli import format_status

    gap = spectral_gap(get_topology("ring"), 4)
    status = JobStatus(name="g", run_id="r", state="RUNNING", step=3, membership_epoch=1, world_size=4, members=(),
                       loss=None, throughput=None, cause=None, run_dir="/tmp/x",
                       topology={"kind": "ring", "world_size": 4, "spectral_gap": gap})
    assert "topology: ring over 4 members, spectral gap 0.6667" in format_status(status)
    assert JobStatus.from_dict(status.to_dict()).topology == status.topology


def reference_accum_adam(optimizer: dict, n: int, global_batch: int, k: int, steps: int) -> list[torch.Tensor]:
    """Decentralized Adam with accumulation ("From promise to practice"), written from its equations on
    flat vectors, one per replica: at step t (from 1) with gradient g at x_i,
        m~ = M + (1 - b1) g,  v~ = V + (1 - b2) g^2,  c = ceil(t / K),
        x_i <- xbar_i (1 - lr wd) - lr (m~ / (1 - b1^c)) / (sqrt(v~ / (1 - b2^c)) + eps),  xbar = W X,
    and every K steps, with gbar the mean of the window's K gradients:
        M <- b1 (M + (1 - b1) gbar),  V <- b2 (V + (1 - b2) gbar^2),  gbar reset."""
    import math

    model, x, y = start_model()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    b1, b2, eps = 0.9, 0.999, 1e-8
    lr, wd = optimizer["lr"], optimizer.get("weight_decay", 0.0)
    dim = flat(model.parameters()).numel()
    moments = [[torch.zeros(dim), torch.zeros(dim), torch.zeros(dim)] for _ in range(n)]  # M, V, window sum
    for step in range(steps):
        t = step + 1
        ids = global_batch_ids(step, global_batch, len(x))
        grads = []
        for i, m in enumerate(replicas):
            index = torch.tensor(share(ids, i, n))
            m.zero_grad()
            F.cross_entropy(m(x[index]), y[index]).backward()
            grads.append(flat(p.grad for p in m.parameters()))
        mixed = literal_w("ring", n, step) @ torch.stack([flat(m.parameters()) for m in replicas])
        c = math.ceil(t / k)
        for i, (m, g) in enumerate(zip(replicas, grads)):
            big_m, big_v, window = moments[i]
            m_t, v_t = big_m + (1 - b1) * g, big_v + (1 - b2) * g * g
            new = mixed[i] * (1 - lr * wd) - lr * (m_t / (1 - b1 ** c)) / ((v_t / (1 - b2 ** c)).sqrt() + eps)
            set_flat(list(m.parameters()), new)
            window += g
            if t % k == 0:
                gbar = window / k
                moments[i] = [b1 * (big_m + (1 - b1) * gbar), b2 * (big_v + (1 - b2) * gbar * gbar), torch.zeros(dim)]
    return [flat(m.parameters()) for m in replicas]


@pytest.mark.parametrize("k", [1, 4])
def test_dadam_is_decentralized_adam_with_accumulation_from_the_papers_equations(tmp_path, wired, k):
    adamw = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "no_decay": []}  # every weight decays, as the reference
    slots = [f"w{i}" for i in range(4)]
    job = LocalJob(config({"policy": "dadam", "k": k, "topology": {"kind": "ring"}}, adamw, 12, 4), slots, str(tmp_path))
    job.run(tuple(slots), 64)
    mine = [flat(job.parameters(s)) for s in slots]
    ref = reference_accum_adam(adamw, 4, 64, k, 12)
    diff = max(float((a - b).abs().max()) for a, b in zip(mine, ref))
    spread = max(float((mine[0] - other).abs().max()) for other in mine[1:])
    print(f"dadam k={k} ring n=4, 12 steps: {diff:.2e} from the equations (replicas {spread:.2e} apart)")
    assert diff <= 1e-6 and spread > 1e-4
