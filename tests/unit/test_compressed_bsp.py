"""BSP with compressed buckets (`compression.codec`, and `bytegrad`), in process against plain-torch
references: each rank's share-weighted gradient, the scatter-gather written out literally, one
optimizer step on the result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from algorithms.policies.compression import get_codec
from tests.unit.test_policy_oracles import SEED, global_batch_ids, make_opt, max_diff, reference_bsp, run_replicas, share, start_model
from tests.unit.test_scatter_gather import _reference

SGD_M = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.001}
STEPS, N, GLOBAL_BATCH = 12, 3, 50  # 50 samples over 3 ranks: shares of 17, 17 and 16


def run(tmp_path, sync: dict, compression: dict) -> list[torch.Tensor]:
    cfg = {"name": "compressed", "seed": SEED, "workers": {"count": N, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "optimizer": SGD_M, "sync": sync, "compression": compression, "stop": {"max_steps": STEPS}, "eval_every": 0}
    return run_replicas(tmp_path, cfg, N, GLOBAL_BATCH)


def reference_training(n: int, reduce) -> list[torch.Tensor]:
    """STEPS optimizer steps on the SUM `reduce(steps)` gives: `steps` holds, for every step so far, each
    rank's gradient of its share's mean loss times n_i / B, flattened as BSP's one bucket lays the
    parameters out (in reverse order)."""
    model, x, y = start_model()
    params = list(model.parameters())
    opt = make_opt(params, SGD_M)
    steps = []
    for step in range(STEPS):
        ids = global_batch_ids(step, GLOBAL_BATCH, len(x))
        flats = []
        for rank in range(n):
            mine = torch.tensor(share(ids, rank, n))
            model.zero_grad()
            (F.cross_entropy(model(x[mine]), y[mine]) * (len(mine) / GLOBAL_BATCH)).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in reversed(params)]))
        steps.append(flats)
        summed = reduce(steps)
        offset = 0
        for p in reversed(params):
            p.grad = summed[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    return [p.detach() for p in params]


def reference_compressed(codec_name: str, feedback: bool, n: int = N) -> list[torch.Tensor]:
    """The reference scatter-gather's SUM of the ranks' gradients (its residuals replay the earlier steps)."""
    return reference_training(n, lambda steps: _reference(get_codec(codec_name), steps, feedback)[-1])


def test_fp16_buckets_stay_within_fp16_rounding_of_uncompressed_bsp(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "bsp"}, {"codec": "fp16"}), reference_bsp(SGD_M, GLOBAL_BATCH))
    print(f"bsp + fp16 vs uncompressed single-process reference, {STEPS} steps: {diff:.2e}")
    assert diff < 1e-4


def test_bytegrad_equals_the_literal_scatter_gather_reference(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "bytegrad"}, {}), reference_compressed("uint8", feedback=False))
    print(f"bytegrad (uint8) vs reference: {diff:.2e}")
    assert diff < 1e-6


def test_onebit_with_error_feedback_equals_its_reference(tmp_path):
    diff = max_diff(run(tmp_path, {"policy": "bsp"}, {"codec": "onebit", "feedback": True}),
                    reference_compressed("onebit", feedback=True))
    print(f"bsp + onebit with error feedback vs reference: {diff:.2e}")
    assert diff < 1e-6


def reference_hierarchical(codec_name: str, nodes: tuple[str, ...], feedback: bool) -> list[torch.Tensor]:
    """BAGUA's hierarchical compressed all-reduce written out: each node's gradients summed in full
    precision at its leader (its ranks in order), then the literal scatter-gather among the leaders (in
    the order of their nodes' first ranks)."""
    order: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node, []).append(rank)
    groups = sorted(order.values())

    def node_sums(flats: list[torch.Tensor]) -> list[torch.Tensor]:
        sums = []
        for ranks in groups:
            total = flats[ranks[0]].clone()
            for r in ranks[1:]:
                total = total + flats[r]
            sums.append(total)
        return sums

    return reference_training(len(nodes), lambda steps: _reference(get_codec(codec_name), [node_sums(f) for f in steps],
                                                                    feedback)[-1])


@pytest.mark.parametrize("nodes", [("a", "a", "b", "b"), ("a", "b", "a", "b")], ids=["2x2", "interleaved"])
def test_hierarchical_bytegrad_compresses_only_between_the_leaders(tmp_path, nodes):
    """`bytegrad` with `sync.hierarchical`: full precision within a node, the compressed scatter-gather
    among the leaders only. Equals the reference written out above; a member that is not its node's
    leader sends its gradients once per step, uncompressed (the flat scatter-gather would send
    2(n-1)/n of them compressed)."""
    from testkit.harness import LocalJob

    slots = ["w0", "w1", "w2", "w3"]
    cfg = {"name": "hier-bytegrad", "seed": SEED, "workers": {"count": 4, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": 8},
           "optimizer": SGD_M, "sync": {"policy": "bytegrad", "hierarchical": True}, "compression": {"codec": "uint8"},
           "stop": {"max_steps": STEPS}, "eval_every": 0}
    job = LocalJob(cfg, slots, str(tmp_path))
    job.run(tuple(slots), GLOBAL_BATCH, nodes=nodes)
    params = job.parameters("w0")
    for slot in slots[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, job.parameters(slot))), f"{slot} differs from w0"
    diff = max_diff(params, reference_hierarchical("uint8", nodes, feedback=False))
    flat = max_diff(params, reference_compressed("uint8", feedback=False, n=4))
    member = job.replicas["w2" if nodes[1] != nodes[0] else "w1"]
    grad_bytes = sum(p.numel() * p.element_size() for p in member.training.model.parameters())
    sent = member.group.comm.bytes_sent / STEPS
    print(f"hierarchical bytegrad {nodes}: {diff:.2e} from its reference ({flat:.2e} from the flat one); a member "
          f"sends {sent:.0f} B/step (gradients {grad_bytes} B)")
    assert diff < 1e-5 and flat > 10 * max(diff, 1e-7), "the leaders' sums, not the members' gradients, are compressed"
    assert grad_bytes <= sent < 1.05 * grad_bytes
