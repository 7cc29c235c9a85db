"""Policy oracles: real replicas (the worker's step loop) in threads over in-process gloo, no Ray,
against plain-torch references written here, with their own sampler and split.

The references follow the rules as a reader would implement them from the README: each member's
share of each global batch, its mean loss, local optimizers, and at a round the replicas (local
SGD) or the pseudo-gradients (DiLoCo) averaged with weights proportional to the samples each
member trained since the previous round.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from algorithms.policies.compression import get_codec
from orchestrator.workloads.digits import mlp
from testkit.harness import LocalJob
from tests.unit.test_scatter_gather import _reference

SEED, STEPS = 3, 12


def config(sync: dict, optimizer: dict, steps: int = STEPS, n: int = 2) -> dict:
    return {"name": "oracle", "seed": SEED, "workers": {"count": n, "cpus": 1},
            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
            "optimizer": optimizer, "sync": sync, "stop": {"max_steps": steps}, "eval_every": 0}


def run(tmp_path, sync: dict, optimizer: dict, n: int, global_batch: int, steps: int = STEPS) -> list[torch.Tensor]:
    return run_replicas(tmp_path, config(sync, optimizer, steps, n), n, global_batch)


def run_replicas(tmp_path, cfg: dict, n: int, global_batch: int) -> list[torch.Tensor]:
    """`cfg` trained by n replicas in process; w0's parameters, after checking every replica ends
    at the same committed state."""
    slots = [f"w{i}" for i in range(n)]
    job = LocalJob(cfg, slots, str(tmp_path))
    job.run(tuple(slots), global_batch)
    return job.agreed_parameters(slots)


# ------------------------------------------------------------------ the references
def global_batch_ids(step: int, size: int, n: int) -> list[int]:
    out = []
    for pos in range(step * size, (step + 1) * size):
        epoch, i = divmod(pos, n)
        out.append(int(np.random.default_rng([SEED, epoch]).permutation(n)[i]))
    return out


def share(ids: list[int], rank: int, world: int) -> list[int]:
    base, extra = divmod(len(ids), world)
    start = rank * base + min(rank, extra)
    return ids[start:start + base + (1 if rank < extra else 0)]


def make_opt(params, cfg: dict) -> torch.optim.Optimizer:
    if cfg["name"] not in ("sgd", "adamw"):  # a torch.optim class by name, its arguments beside the name
        schedule = ("name", "warmup_steps", "schedule", "min_lr")
        cls = getattr(torch.optim, cfg["name"].removeprefix("torch.optim."))
        return cls(params, **{k: v for k, v in cfg.items() if k not in schedule})
    if cfg["name"] == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg.get("momentum", 0), nesterov=cfg.get("nesterov", False),
                               weight_decay=cfg.get("weight_decay", 0))
    return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0))


def start_model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(SEED)
    workload = mlp(hidden=16)
    x, y = workload.train_data.tensors
    return workload.model, x, y


def reference_bsp(optimizer: dict, global_batch: int, steps: int = STEPS) -> list[torch.Tensor]:
    model, x, y = start_model()
    opt = make_opt(model.parameters(), optimizer)
    warm, floor = optimizer.get("warmup_steps", 0), optimizer.get("min_lr", 0.0) / optimizer["lr"]

    def factor(step: int) -> float:  # the README's schedule: linear warm-up, then cosine down to min_lr at the last step
        if step < warm:
            return (step + 1) / warm
        if optimizer.get("schedule") == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
        return 1.0
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    for step in range(steps):
        index = torch.tensor(global_batch_ids(step, global_batch, len(x)))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        opt.step()
        schedule.step()
    return [p.detach() for p in model.parameters()]


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def set_flat(params, vector: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(vector[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def reference_periodic(optimizer: dict, n: int, global_batch: int, h: int, steps: int = STEPS, outer: dict | None = None,
                       fragments: int = 1, overlap: int = 0, alpha: float = 1.0, codec: str | None = None,
                       feedback: bool = False, keep: dict | None = None) -> list[torch.Tensor]:
    """n replicas in one process. Without `outer`: local SGD. With it: (streaming) DiLoCo on the flat
    parameter vector cut into `fragments` equal slices, fragment f synchronized after steps
    (f + 1) h / fragments + k h, merged `overlap` steps later (adopted when overlap is 0); a round's
    pseudo-gradient weighs each member by the samples it trained since that fragment's previous
    launch. At the stop a round in flight lands (blended), then every fragment has a final round
    merged at once, so every replica ends at the outer parameters. With `codec`,
    a round's weighted payloads are summed by the literal scatter-gather reference, each fragment's
    rounds in turn (its error-feedback residuals replay that fragment's earlier rounds). `keep` (a dict)
    receives the replicas and their optimizers at the end."""
    model, x, y = start_model()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    opts = [make_opt(m.parameters(), optimizer) for m in replicas]
    size = flat(model.parameters()).numel()
    cuts = [round(k * size / fragments) for k in range(fragments + 1)]
    glob = [flat(model.parameters())[cuts[f]:cuts[f + 1]].clone().requires_grad_() for f in range(fragments)]
    outer_opt = torch.optim.SGD(glob, lr=outer["lr"], momentum=outer["momentum"], nesterov=outer["nesterov"]) if outer else None
    trained = [0] * n
    since = [[0] * n for _ in range(fragments)]
    inflight: dict[int, tuple[int, int, torch.Tensor]] = {}  # fragment -> (launched after, merge after, mean)
    sent: list[list[list[torch.Tensor]]] = [[] for _ in range(fragments)]  # per fragment, each round's payloads

    def merge(f: int, step: int) -> None:
        """The outer step on fragment f's mean pseudo-gradient; every replica adopts the outer fragment,
        or blends it in (alpha) when local steps ran since the round's launch."""
        launched, _, mean = inflight.pop(f)
        if outer is not None:
            for k, g in enumerate(glob):
                g.grad = mean.clone() if k == f else None
            outer_opt.step()
            mean = glob[f].detach()
        for m in replicas:
            vector = flat(m.parameters())
            local = vector[cuts[f]:cuts[f + 1]]
            vector[cuts[f]:cuts[f + 1]] = torch.lerp(local, mean, alpha) if step > launched else mean
            set_flat(list(m.parameters()), vector)

    for step in range(1, steps + 1):
        ids = global_batch_ids(step - 1, global_batch, len(x))
        for i, (m, opt) in enumerate(zip(replicas, opts)):
            index = torch.tensor(share(ids, i, n))
            opt.zero_grad()
            F.cross_entropy(m(x[index]), y[index]).backward()
            opt.step()
            trained[i] += len(index)
        for f in range(fragments):
            offset = (f + 1) * h // fragments
            due = step == steps or (step >= offset and (step - offset) % h == 0)
            if step == steps and f in inflight:  # the stop: a round in flight lands first (blended) ...
                merge(f, step)
            if due and f not in inflight:  # ... and every fragment has a final round, adopted at once
                w = [trained[i] - since[f][i] for i in range(n)]
                local = [flat(m.parameters())[cuts[f]:cuts[f + 1]] for m in replicas]
                if outer is None:
                    payloads = [wi * li for wi, li in zip(w, local)]
                else:
                    payloads = [wi * (glob[f].detach() - li) for wi, li in zip(w, local)]
                if codec is None:
                    mean = sum(payloads) / sum(w)
                else:
                    sent[f].append(payloads)
                    mean = _reference(get_codec(codec), sent[f], feedback)[-1] / sum(w)
                inflight[f] = (step, step if step == steps else step + overlap, mean)
                since[f] = list(trained)
            if f in inflight and (step >= inflight[f][1] or step == steps):
                merge(f, step)
    if keep is not None:
        keep.update(replicas=replicas, opts=opts)
    return [p.detach() for p in replicas[0].parameters()]


def max_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


SGD_M = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.001}
ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "no_decay": []}  # every weight decays, as the reference
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


# ------------------------------------------------------------------ the oracles
@pytest.mark.parametrize("n,global_batch", [(2, 32), (3, 50), (4, 64)])
def test_bsp_in_process_equals_single_process(tmp_path, n, global_batch):
    diff = max_diff(run(tmp_path, {"policy": "bsp", "bucket_mb": 0.004}, SGD_M, n, global_batch),
                    reference_bsp(SGD_M, global_batch))
    print(f"bsp n={n} B={global_batch}: {diff:.2e}")
    assert diff < 1e-6


NESTEROV = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0005}
ADAMW_WARMUP_COSINE = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "no_decay": [], "warmup_steps": 4, "schedule": "cosine",
                       "min_lr": 0.001}


@pytest.mark.parametrize("optimizer,n,global_batch", [(NESTEROV, 4, 64), (ADAMW_WARMUP_COSINE, 3, 50)],
                         ids=["sgd_nesterov-4", "adamw_warmup_cosine-3"])
def test_bsp_in_process_with_nesterov_or_adamw_and_a_schedule_equals_single_process(tmp_path, optimizer, n, global_batch):
    """The optimizers and the learning-rate schedule of the Ray oracle (tests/integration/test_bsp_oracle.py),
    here with real replicas in threads: torch's own optimizer and LambdaLR on the concatenated batch."""
    diff = max_diff(run(tmp_path, {"policy": "bsp", "bucket_mb": 0.004}, optimizer, n, global_batch),
                    reference_bsp(optimizer, global_batch))
    print(f"bsp n={n} B={global_batch} {optimizer['name']}: {diff:.2e}")
    assert diff < 1e-6


@pytest.mark.parametrize("n,global_batch", [(2, 32), (3, 50), (4, 64)])
def test_local_sgd_h1_equals_bsp(tmp_path, n, global_batch):
    """Own mean losses and sample-weighted averaging with local momentum: h = 1 is BSP (n = 3 on a
    global batch of 50, which 3 does not divide)."""
    diff = max_diff(run(tmp_path, {"policy": "local_sgd", "h": 1}, SGD_M, n, global_batch), reference_bsp(SGD_M, global_batch))
    print(f"local_sgd h=1 n={n} B={global_batch} vs bsp: {diff:.2e}")
    assert diff < 1e-6


@pytest.mark.parametrize("optimizer", [SGD_M, ADAMW], ids=["sgd", "adamw"])
def test_local_sgd_h4_equals_n_replica_simulation(tmp_path, optimizer):
    diff = max_diff(run(tmp_path, {"policy": "local_sgd", "h": 4}, optimizer, 3, 50),
                    reference_periodic(optimizer, 3, 50, h=4))
    print(f"local_sgd h=4 (3 rounds) {optimizer['name']}: {diff:.2e}")
    assert diff < 1e-5


def test_diloco_plain_outer_sgd_h1_equals_local_sgd(tmp_path):
    plain = {"policy": "diloco", "h": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
    diff = max_diff(run(tmp_path, plain, SGD_M, 3, 50), run(tmp_path / "b", {"policy": "local_sgd", "h": 1}, SGD_M, 3, 50))
    print(f"diloco (outer lr 1, no momentum) h=1 vs local_sgd h=1: {diff:.2e}")
    assert diff < 1e-6


def test_diloco_h4_nesterov_equals_reference(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "diloco", "h": 4}, SGD_M, 3, 50),
                    reference_periodic(SGD_M, 3, 50, h=4, outer=OUTER))
    print(f"diloco h=4 outer nesterov (3 rounds): {diff:.2e}")
    assert diff < 1e-5


def test_streaming_one_fragment_without_overlap_equals_diloco(tmp_path):
    streaming = {"policy": "streaming_diloco", "h": 4, "fragments": 1, "overlap": 0}
    diff = max_diff(run(tmp_path, streaming, SGD_M, 3, 50), run(tmp_path / "b", {"policy": "diloco", "h": 4}, SGD_M, 3, 50))
    print(f"streaming (1 fragment, overlap 0) vs diloco: {diff:.2e}")
    assert diff == 0.0


def test_streaming_four_fragments_overlap_one_equals_staggered_reference(tmp_path):
    streaming = {"policy": "streaming_diloco", "h": 8, "fragments": 4, "overlap": 1, "alpha": 0.5}
    mine = run(tmp_path, streaming, SGD_M, 3, 50, steps=24)
    ref = reference_periodic(SGD_M, 3, 50, h=8, steps=24, outer=OUTER, fragments=4, overlap=1, alpha=0.5)
    diff = max_diff(mine, ref)
    print(f"streaming 4 fragments, overlap 1 (24 steps): {diff:.2e}")
    assert diff < 1e-5


def test_streaming_stop_on_a_blended_merge_step_ends_at_the_reference_and_counts_every_sample_once(tmp_path):
    """h 4, 2 fragments, overlap 1, alpha 0.5, stop at step 11: fragment 0's round launched after step
    10 merges blended at the stop, then every fragment has its final round. The final model is the
    reference's, and each fragment's rounds together count every sample trained exactly once (the
    overlap steps' samples belong to that fragment's next round, the final one included)."""
    streaming = {"policy": "streaming_diloco", "h": 4, "fragments": 2, "overlap": 1, "alpha": 0.5}
    slots = ["w0", "w1", "w2"]
    job = LocalJob(config(streaming, SGD_M, 11, 3), slots, str(tmp_path))
    job.run(tuple(slots), 50)
    mine = job.parameters("w0")
    assert all(torch.equal(a, b) for s in slots[1:] for a, b in zip(mine, job.parameters(s)))
    diff = max_diff(mine, reference_periodic(SGD_M, 3, 50, h=4, steps=11, outer=OUTER, fragments=2, overlap=1,
                                             alpha=0.5))
    counted = [r["samples"] for r in job.link.records]
    print(f"streaming, stop on a blended merge (11 steps): {diff:.2e} from the reference; rounds' samples "
          f"{counted} (sum {sum(counted)} of {2 * 11 * 50}); losses {[round(r['loss'], 3) for r in job.link.records]}")
    assert diff < 1e-5
    assert sum(counted) == 2 * 11 * 50 and 0 not in counted, "a sample counted twice or never in a fragment's rounds"
    assert all(r["loss"] > 0 for r in job.link.records), "a round reported loss 0.0"


@pytest.mark.parametrize("steps", [7, 10])
def test_streaming_ends_with_every_replica_equal_when_the_stop_lands_inside_an_overlap(tmp_path, steps):
    """h 4, 2 fragments, overlap 1: fragment 0's round launched at step 6 merges at 7 blended with a
    local step (alpha 0.5), which leaves the replicas apart; the final rounds must bring every
    fragment to the exact average (`run` asserts every replica equals w0's)."""
    streaming = {"policy": "streaming_diloco", "h": 4, "fragments": 2, "overlap": 1, "alpha": 0.5}
    run(tmp_path, streaming, SGD_M, 3, 50, steps=steps)


def test_a_switch_out_of_streaming_diloco_synchronizes_every_fragment_first_and_loses_no_sample(tmp_path):
    """The online trial's switch away from streaming DiLoCo (h 4, 2 fragments, overlap 1, alpha 0.5), whose
    replicas differ at every commit point: w0 sees a plan switching to BSP during step 7; the members adopt
    it at a round's merge (step 7's, where a member launched its round after the plan arrived, else step
    9's), synchronize every fragment there as at a stop, and run BSP to step 14 from rank 0's inner
    optimizer state. The model is the streaming reference stopped at that step, then single-process SGD on
    the global batches; every step's global batch is trained exactly once across the members."""
    from core.schema import JobConfig, parse

    streaming = {"policy": "streaming_diloco", "h": 4, "fragments": 2, "overlap": 1, "alpha": 0.5}
    slots, total, global_batch = ["w0", "w1", "w2"], 14, 50
    cfg = {**config(streaming, SGD_M, total, 3), "faults": {"record_samples": True}}
    job = LocalJob(cfg, slots, str(tmp_path))
    bsp = {"label": "bsp", "sync": {"policy": "bsp"}, "compression": parse(JobConfig, cfg).to_dict()["compression"],
           "fresh": True}
    fire = job.replicas["w0"].faults.maybe_fire

    def publish_at_step_seven(kind: str, step: int) -> None:  # w0's plan arrives while it trains step 7
        if kind == "step" and step == 6 and job.version == 1:
            job.publish(tuple(slots), 2, global_batch, policy=bsp)
        fire(kind, step)

    job.replicas["w0"].faults.maybe_fire = publish_at_step_seven
    job.run(tuple(slots), global_batch)
    params = job.parameters("w0")
    for slot in slots[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, job.parameters(slot))), f"{slot} differs from w0"
    switched = [r["step"] for r in job.link.records if r.get("policy") == "bsp"]
    switch_at = switched[0] - 1
    assert switch_at in (7, 9) and switched == list(range(switch_at + 1, total + 1)), switched
    # the reference: streaming to its stop at the switch's step, then BSP from replica 0's optimizer
    kept: dict = {}
    reference_periodic(SGD_M, 3, global_batch, h=4, steps=switch_at, outer=OUTER, fragments=2, overlap=1, alpha=0.5,
                       keep=kept)
    model, opt = kept["replicas"][0], kept["opts"][0]
    _, x, y = start_model()
    for step in range(switch_at, total):
        index = torch.tensor(global_batch_ids(step, global_batch, len(x)))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        opt.step()
    diff = max_diff(params, [p.detach() for p in model.parameters()])
    trained: dict[int, list[int]] = {}
    for path in (tmp_path / "samples").glob("*.txt"):
        for line in path.read_text().splitlines():
            step, _epoch, *ids = map(int, line.split())
            trained.setdefault(step, []).extend(ids)
    print(f"streaming -> bsp at step {switch_at}: {diff:.2e} from the reference; steps in the ledger {sorted(trained)}")
    assert diff < 1e-5
    assert sorted(trained) == list(range(1, total + 1))
    for step, ids in trained.items():
        assert sorted(ids) == sorted(global_batch_ids(step - 1, global_batch, len(x))), f"step {step}'s samples"


@pytest.mark.parametrize("leaders", ["subgroup", "point-to-point"])
@pytest.mark.parametrize("nodes", [("a", "a", "b", "b"), ("a", "b", "a", "b")], ids=["2x2", "interleaved"])
def test_hierarchical_bsp_equals_single_process_and_sends_once_per_node(tmp_path, nodes, leaders, monkeypatch):
    """`sync.hierarchical`: reduce to each node's leader, ring among leaders, back to the members. The
    same model as the single-process reference (and so as flat BSP), and a member that is not its
    node's leader sends its gradients once per step (the flat ring sends 2(n-1)/n of them)."""
    if leaders == "point-to-point":  # a backend that forms no subgroup: the leaders' ring of messages
        from actors.transport.comm import GlooCommunicator
        monkeypatch.setattr(GlooCommunicator, "subgroup", lambda self, ranks, tag: None)
    slots = ["w0", "w1", "w2", "w3"]
    job = LocalJob(config({"policy": "bsp", "hierarchical": True, "bucket_mb": 0.004}, SGD_M, n=4), slots, str(tmp_path))
    job.run(tuple(slots), 64, nodes=nodes)
    params = job.parameters("w0")
    for slot in slots[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, job.parameters(slot))), f"{slot} differs from w0"
    diff = max_diff(params, reference_bsp(SGD_M, 64))
    member = job.replicas["w2" if nodes[1] != nodes[0] else "w1"]  # not a leader
    grad_bytes = sum(p.numel() * p.element_size() for p in member.training.model.parameters())
    sent = member.group.comm.bytes_sent / STEPS
    print(f"hierarchical bsp {nodes}: {diff:.2e} from the reference; a member sends {sent:.0f} B/step "
          f"(gradients {grad_bytes} B)")
    assert diff < 1e-6
    assert sent <= 1.05 * grad_bytes  # once, with the vote's tail; a flat ring member sends 1.5x (2(n-1)/n)
    assert member.policy.impl.hierarchy is not None and not member.policy.impl.hierarchy.is_leader
    leader = job.replicas["w0"].policy.impl.hierarchy
    assert leader.is_leader and bool(leader._leader_group) == (leaders == "subgroup")
    assert grad_bytes <= sent < 1.2 * grad_bytes
