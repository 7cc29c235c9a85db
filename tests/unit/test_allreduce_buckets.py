"""BSP buckets without Ray: planning, launch order from gradient hooks, one all-reduce per bucket."""
from __future__ import annotations

import torch
from torch import nn

from algorithms.policies.allreduce import AllReduce, plan_buckets
from algorithms.policies.base import EpochInfo, VoteDraft
from core.schema import BSPConfig
from testkit.harness import LoopbackComm

EPOCH = EpochInfo(rank=0, world_size=1, members=("w0",), global_batch=8)


def bsp(model: nn.Module, bucket_mb: float = 0.04):
    return AllReduce(BSPConfig(bucket_mb=bucket_mb)).bind(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def test_plan_buckets_reverse_order_and_size_bound():
    sizes = [(1000, torch.float32)] * 6
    plan = plan_buckets(sizes, bucket_bytes=8000)
    assert plan.buckets == ((5, 4), (3, 2), (1, 0))


def test_plan_buckets_splits_by_dtype():
    sizes = [(10, torch.float32), (10, torch.float64), (10, torch.float64)]
    assert plan_buckets(sizes, 1 << 20).buckets == ((2, 1), (0,))


def test_single_oversized_parameter_gets_its_own_bucket():
    plan = plan_buckets([(10, torch.float32), (10_000, torch.float32), (10, torch.float32)], bucket_bytes=100)
    assert plan.buckets == ((2,), (1,), (0,))


def _step(impl, model, draft):
    impl.begin_step(0, draft)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    impl.end_backward(0)
    return impl.finish_step(0, draft)


def test_first_bucket_launches_before_last_hook_and_once_per_step():
    model = _model()
    impl = bsp(model)  # ~40 KB: several buckets
    assert len(impl.plan.buckets) >= 2
    comm = LoopbackComm()
    impl.on_membership(comm, EPOCH)
    for _ in range(2):
        impl.trace = []
        _step(impl, model, VoteDraft(1.0, 8))
        launches = [i for i, (kind, _) in enumerate(impl.trace) if kind == "launch"]
        hooks = [i for i, (kind, _) in enumerate(impl.trace) if kind == "hook"]
        assert launches[0] < hooks[-1], "bucket 0 must be launched while backward still produces gradients"
        assert [impl.trace[i][1] for i in launches] == list(range(len(impl.plan.buckets)))
    assert len(comm.calls) == 2 * len(impl.plan.buckets)


def test_grads_are_bucket_views_and_match_plain_backward():
    model, reference = _model(), _model()
    impl = bsp(model)
    impl.on_membership(LoopbackComm(), EPOCH)
    torch.manual_seed(1)
    vote = _step(impl, model, VoteDraft(2.5, 8, newer_plan=True))
    torch.manual_seed(1)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert (vote.commit, vote.loss, vote.samples, vote.newer_plan) == (True, 2.5, 8, True)


def test_second_step_starts_from_zero_gradients():
    model = _model()
    impl = bsp(model)
    impl.on_membership(LoopbackComm(), EPOCH)
    torch.manual_seed(2)
    _step(impl, model, VoteDraft())
    first = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(2)
    _step(impl, model, VoteDraft())
    for g, p in zip(first, model.parameters()):
        assert torch.equal(g, p.grad)


def test_new_membership_gets_fresh_buffers():
    model = _model()
    impl = bsp(model)
    impl.on_membership(LoopbackComm(), EPOCH)
    _step(impl, model, VoteDraft())
    held = list(impl.buffers)  # as a stuck collective of the old epoch holds them
    impl.on_membership(LoopbackComm(), EPOCH)
    assert not {b.data_ptr() for b in held} & {b.data_ptr() for b in impl.buffers}


def test_accumulated_micro_steps_reduce_once_and_match_the_whole_batch():
    """Gradient accumulation: 3 micro-steps (weighted by their share) give the whole batch's
    gradient, in the same bucket views, with one all-reduce per bucket, launched in the last."""
    model, reference = _model(), _model()
    impl = bsp(model)
    comm = LoopbackComm()
    impl.on_membership(comm, EPOCH)
    torch.manual_seed(3)
    x, y = torch.randn(10, 64), torch.randint(0, 10, (10,))
    impl.trace = []
    draft = VoteDraft()
    impl.begin_step(0, draft)
    chunks = [(0, 4), (4, 8), (8, 10)]
    for i, (a, b) in enumerate(chunks):
        impl.accumulating = i < len(chunks) - 1
        (nn.functional.cross_entropy(model(x[a:b]), y[a:b]) * ((b - a) / 10)).backward()
        if impl.accumulating:
            assert comm.calls == [], "no bucket may be reduced before the last micro-step"
    impl.accumulating = False
    impl.end_backward(0)
    impl.finish_step(0, draft)
    assert len(comm.calls) == len(impl.plan.buckets)
    first_launch = next(i for i, (kind, _) in enumerate(impl.trace) if kind == "launch")
    assert first_launch > len(impl.trace) - 1 - len(impl.params), "launched during the last backward"
    nn.functional.cross_entropy(reference(x), y).backward()
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters())):
        assert p.grad.data_ptr() == impl._ptrs[i], "accumulation must stay in the bucket view"
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
