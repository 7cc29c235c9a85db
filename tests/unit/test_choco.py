"""`choco` (CHOCO-SGD) and the codecs in `dpsgd`, in process without Ray: real replicas (the worker's
step loop) in threads over in-process gloo, against a plain-torch simulation of the n replicas that
follows CHOCO literally (gradient step; q = Q(x - x̂_self); every holder adds the same q_j to x̂_j;
x <- x + gamma_c sum_j W_ij (x̂_j - x̂_i)) with the same deterministic codec and the literal W."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from algorithms.policies import base
from algorithms.policies.compression import get_codec
from algorithms.policies.gossip import Choco, ChocoImpl
from algorithms.rules.kinds import DECENTRALIZED
from algorithms.rules.topologies import get_topology
from core.schema import ChocoConfig, ConfigError, parse
from orchestrator.config import config_from_dict
from testkit.harness import LocalJob
from tests.unit.test_gossip import SGD, STEPS, reference_gossip
from tests.unit.test_policy_oracles import config, flat, global_batch_ids, make_opt, max_diff, set_flat, share, start_model

MOMENTUM = {"name": "sgd", "lr": 0.1, "momentum": 0.5}


def run_codec(tmp_path, sync: dict, codec: str, optimizer: dict, n: int, global_batch: int) -> list[list[torch.Tensor]]:
    cfg = config(sync, optimizer, STEPS, n)
    cfg["compression"] = {"codec": codec, "feedback": codec == "onebit"}
    slots = [f"w{i}" for i in range(n)]
    job = LocalJob(cfg, slots, str(tmp_path))
    job.run(tuple(slots), global_batch)
    return [job.parameters(s) for s in slots]


def quantize(codec: str, x: torch.Tensor) -> torch.Tensor:
    """What a holder decodes of x sent through `codec` (exact when `none`)."""
    if codec == "none":
        return x.clone()
    c = get_codec(codec)
    return c.decompress(c.compress(x), x.numel())


def reference_choco(kind: str, codec: str, optimizer: dict, n: int, global_batch: int, gamma: float = 1.0):
    """n replicas in one process, CHOCO in its literal order, truncated after the last gradient step
    (the implementation's committed state is the point before a step's gossip)."""
    model, x, y = start_model()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    opts = [make_opt(m.parameters(), optimizer) for m in replicas]
    topology = get_topology(kind)
    public = torch.zeros(n, flat(model.parameters()).numel())  # every holder's x̂_j is the same
    for step in range(STEPS):
        ids = global_batch_ids(step, global_batch, len(x))
        for i, (m, opt) in enumerate(zip(replicas, opts)):
            index = torch.tensor(share(ids, i, n))
            opt.zero_grad()
            F.cross_entropy(m(x[index]), y[index]).backward()
            opt.step()
        if step == STEPS - 1:
            break
        half = torch.stack([flat(m.parameters()) for m in replicas])
        public = public + torch.stack([quantize(codec, half[i] - public[i]) for i in range(n)])
        for i, m in enumerate(replicas):  # the sum over the row in the topology's order: the same rounding
            terms = [gamma * weight * (public[j] - public[i]) for j, weight in topology.peers(i, n) if j != i]
            set_flat(list(m.parameters()), half[i] + sum(terms))
    return [[p.detach() for p in m.parameters()] for m in replicas]


@pytest.mark.parametrize("codec", ["uint8", "none"])
@pytest.mark.parametrize("n,global_batch,kind", [(4, 64, "ring"), (5, 60, "torus")])
def test_choco_equals_the_literal_n_replica_simulation(tmp_path, codec, n, global_batch, kind):
    sync = {"policy": "choco", "topology": {"kind": kind}, "consensus_every": 0}
    mine = run_codec(tmp_path, sync, codec, MOMENTUM, n, global_batch)
    ref = reference_choco(kind, codec, MOMENTUM, n, global_batch)
    diff = max(max_diff(a, b) for a, b in zip(mine, ref))
    spread = max(max_diff(mine[0], other) for other in mine[1:])
    exact = reference_choco(kind, "none", MOMENTUM, n, global_batch) if codec != "none" else ref
    from_exact = max(max_diff(a, b) for a, b in zip(mine, exact))
    print(f"choco {kind} n={n} {codec}: {diff:.2e} from the reference (replicas {spread:.2e} apart; "
          f"{from_exact:.2e} from exact-difference CHOCO)")
    assert diff < 1e-5
    assert spread > 1e-4, "the replicas differ: an exact all-reduce would not pass"
    if codec != "none":
        assert from_exact > 1e-4, "the codec's rounding shows: the comparison tells the codec apart"


def test_choco_consensus_lr_is_used(tmp_path):
    sync = {"policy": "choco", "topology": {"kind": "ring"}, "consensus_every": 0, "consensus_lr": 0.5}
    mine = run_codec(tmp_path, sync, "uint8", SGD, 4, 64)
    diff = max(max_diff(a, b) for a, b in zip(mine, reference_choco("ring", "uint8", SGD, 4, 64, gamma=0.5)))
    other = max(max_diff(a, b) for a, b in zip(mine, reference_choco("ring", "uint8", SGD, 4, 64, gamma=1.0)))
    print(f"choco gamma_c 0.5: {diff:.2e} from its reference, {other:.2e} from gamma_c 1")
    assert diff < 1e-5 and other > 1e-4


def test_choco_sends_a_quarter_of_dpsgd_s_bytes_with_uint8(tmp_path):
    slots = ["w0", "w1", "w2", "w3"]
    sent = {}
    for policy, codec in (("dpsgd", "none"), ("choco", "uint8")):
        cfg = config({"policy": policy, "consensus_every": 0}, SGD, STEPS, 4)
        cfg["compression"] = {"codec": codec}
        job = LocalJob(cfg, slots, str(tmp_path / policy))
        job.run(tuple(slots), 64)
        sent[policy] = job.replicas["w0"].group.comm.bytes_sent
    ratio = sent["choco"] / sent["dpsgd"] * STEPS / (STEPS - 1)  # choco's first step of an epoch sends nothing
    print(f"bytes per exchanging step, choco uint8 / dpsgd fp32: {ratio:.4f}")
    assert 0.25 <= ratio <= 0.26


@pytest.mark.parametrize("codec,tol", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_dpsgd_with_a_cast_codec_stays_within_its_tolerance(tmp_path, codec, tol):
    mine = run_codec(tmp_path, {"policy": "dpsgd", "topology": {"kind": "ring"}, "consensus_every": 0}, codec, SGD, 4, 64)
    ref = reference_gossip("ring", SGD, 4, 64)
    diff = max(max_diff(a, b) for a, b in zip(mine, ref))
    print(f"dpsgd ring with {codec}: {diff:.2e} from fp32")
    assert 0 < diff < tol


def test_dpsgd_with_uint8_equals_the_simulation_that_mixes_decoded_parameters(tmp_path):
    """Each member mixes its own exact x_i with its peers' decoded x_j."""
    n, global_batch = 4, 64
    mine = run_codec(tmp_path, {"policy": "dpsgd", "topology": {"kind": "ring"}, "consensus_every": 0}, "uint8",
                     SGD, n, global_batch)
    model, x, y = start_model()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    opts = [make_opt(m.parameters(), SGD) for m in replicas]
    w = torch.tensor(get_topology("ring").matrix(n), dtype=torch.float32)
    for step in range(STEPS):
        ids = global_batch_ids(step, global_batch, len(x))
        params = torch.stack([flat(m.parameters()) for m in replicas])
        decoded = torch.stack([quantize("uint8", p) for p in params])
        for i, (m, opt) in enumerate(zip(replicas, opts)):
            index = torch.tensor(share(ids, i, n))
            opt.zero_grad()
            F.cross_entropy(m(x[index]), y[index]).backward()
        for i, (m, opt) in enumerate(zip(replicas, opts)):
            mixed = sum(w[i, j] * (params[i] if j == i else decoded[j]) for j in range(n) if w[i, j] != 0)
            set_flat(list(m.parameters()), mixed)
            opt.step()
    diff = max(max_diff(a, [p.detach() for p in b.parameters()]) for a, b in zip(mine, replicas))
    print(f"dpsgd ring with uint8: {diff:.2e} from the decoded-mixing simulation")
    assert diff < 1e-5


# ------------------------------------------------------------------ config
def test_choco_is_registered_and_a_job_naming_it_is_accepted():
    cfg = config_from_dict({"name": "c", "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                            "sync": {"policy": "choco", "consensus_lr": 0.5}, "compression": {"codec": "uint8"}})
    assert cfg.sync.consensus_lr == 0.5 and base.get_algorithm("choco") is Choco
    assert Choco.kind is DECENTRALIZED and Choco.impl is ChocoImpl


@pytest.mark.parametrize("over,match", [
    ({"topology": {"kind": "one_peer_exp"}}, "choco needs a static topology"),
    ({"topology": {"kind": "matching"}}, "choco needs a static topology"),
    ({"consensus_lr": 0.0}, r"consensus_lr: must be in \(0, 1\]"),
    ({"consensus_lr": 1.5}, r"consensus_lr: must be in \(0, 1\]"),
])
def test_bad_choco_settings_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        parse(ChocoConfig, {"policy": "choco", **over}, "sync")


@pytest.mark.parametrize("policy", ["dpsgd", "dadam"])
def test_onebit_on_gossiped_parameters_is_refused_pointing_at_choco(policy):
    with pytest.raises(ConfigError, match="use fp16, bf16 or uint8, or policy choco"):
        config_from_dict({"name": "c", "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                          "optimizer": {"name": "adamw"}, "sync": {"policy": policy},
                          "compression": {"codec": "onebit", "feedback": True}})


# ------------------------------------------------------------------ elastic
def test_a_split_choco_exchange_leaves_the_live_replicas_average_unchanged(tmp_path, monkeypatch):
    """w1's receive of step 3 fails after its peers applied the exchange; the entry undoes their terms
    gamma_c W_ij (x̂_j - x̂_i), which cancel pairwise since both ends hold the same copies."""
    from tests.unit.test_gossip import run_through_split
    before, after, records = run_through_split(tmp_path, monkeypatch, "recv", undo=True, policy="choco", codec="uint8")
    undone = sum(r.get("undone_terms", 0) for r in records)
    drift = float((after - before).abs().max())
    print(f"choco split: {undone} terms undone, the average moved {drift:.2e}")
    assert undone >= 1 and drift <= 1e-6


def test_without_the_undo_a_split_choco_exchange_moves_the_average(tmp_path, monkeypatch):
    from tests.unit.test_gossip import run_through_split
    before, after, _ = run_through_split(tmp_path, monkeypatch, "recv", undo=False, policy="choco", codec="uint8")
    drift = float((after - before).abs().max())
    print(f"choco split without the undo: the average moved {drift:.2e}")
    assert drift > 1e-4


def test_public_copies_start_again_from_zero_at_every_entry():
    """Two members over in-process gloo: a step exchanges and fills the copies; a new membership epoch
    empties them, and its first step sends nothing (there is nothing to gossip yet)."""
    from concurrent.futures import ThreadPoolExecutor

    from algorithms.policies.base import EpochInfo
    from core import schema
    from testkit.harness import drive_step, local_group

    algo = Choco(parse(ChocoConfig, {"policy": "choco", "consensus_every": 0}), schema.CompressionConfig(codec="uint8"))
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    impls = [algo.bind(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in models]
    members = ("w0", "w1")

    def step(rank: int, s: int) -> None:
        drive_step(impls[rank], models[rank], s, torch.randn(3, 4), samples=1, lr=0.1)

    for epoch in (1, 2):
        comms = local_group(2, name=f"choco-entry-{epoch}")
        for rank in range(2):
            impls[rank].on_membership(comms[rank], EpochInfo(rank, 2, members, 2, membership_epoch=epoch))
        assert all(impl.public == {} for impl in impls), "the copies start from zero in every epoch"
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: step(r, 0), range(2)))
        assert [c.bytes_sent for c in comms] == [0, 0], "the first step of an epoch has nothing to gossip"
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: step(r, 1), range(2)))
        assert all(c.bytes_sent > 0 for c in comms) and all(set(impl.public) == {0, 1} for impl in impls)
        assert torch.equal(impls[0].public[1], impls[1].public[1]), "every holder of a copy holds the same copy"
        for impl in impls:
            impl.on_epoch_end("test: a new plan")
