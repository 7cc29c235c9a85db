"""This project's SGD: torch.optim.SGD's rule on whole flat buffers, bit-identical to torch's own
step, laid out again whenever a parameter, gradient or momentum buffer was replaced, with torch's
state_dict format, and without importing torch._dynamo."""
from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from algorithms.policies.optim import SGD, contiguous_runs

SIZES = [(33, 7), (7,), (16, 16), (16,), (5, 3), (3,)]
CONFIGS = [dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
           dict(momentum=0.5, dampening=0.1, weight_decay=1e-2), dict(momentum=0.0), dict(momentum=0.0, weight_decay=1e-3)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SIZES]


def _bucket_grads(params, order) -> torch.Tensor:
    """Gradients as views into one flat bucket (as the all-reduce leaves them), in `order`."""
    bucket = torch.zeros(sum(p.numel() for p in params) + 3)  # + a vote tail, as in the reducer's bucket
    offset = 3
    for i in order:
        params[i].grad = bucket[offset:offset + params[i].numel()].view_as(params[i])
        offset += params[i].numel()
    return bucket


def _fill(params, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad.copy_(torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_bit_identical_to_torch_sgd_through_relayouts(cfg):
    ref, mine = _params(0), _params(0)
    ref_opt = torch.optim.SGD(ref, lr=0.1, foreach=False, **cfg)
    opt = SGD(mine, lr=0.1, **cfg)
    for p in ref:
        p.grad = torch.zeros_like(p)
    _bucket_grads(mine, order=[5, 4, 3, 2, 1, 0])  # the reducer's order: last parameters first
    for step in range(12):
        lr = 0.1 / (step + 1)
        _fill(ref, step)
        _fill(mine, step)
        for opt_ in (ref_opt, opt):
            opt_.param_groups[0]["lr"] = lr
            opt_.step()
        if step == 0:
            assert len(opt._runs) == 1, "bucket views must take the flat path"
        if step == 3:  # a new membership epoch: new buckets, another order
            _bucket_grads(mine, order=[0, 2, 1, 3, 5, 4])
        if step == 5:  # a joiner's load: the optimizer's state is replaced (torch's own, as a checkpoint holds it)
            opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        if step == 7:  # user code (or vector_to_parameters) replaces a parameter's data
            mine[2].data = mine[2].detach().clone()
        if step == 9:  # gradients that are separate tensors: per-tensor steps
            for p in mine:
                p.grad = p.grad.clone()
        for a, b in zip(ref, mine):
            assert torch.equal(a, b), f"step {step}: parameters differ by {(a - b).abs().max().item()}"
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert (s["momentum_buffer"] is None) == (ours["state"][i]["momentum_buffer"] is None)
        if s["momentum_buffer"] is not None:
            assert torch.equal(s["momentum_buffer"], ours["state"][i]["momentum_buffer"])


def _two_bucketed_steps(seed: int = 1):
    """Parameters, and this project's SGD (momentum 0.9) after two steps on gradients in one bucket."""
    params = _params(seed)
    opt = SGD(params, lr=0.1, momentum=0.9)
    _bucket_grads(params, order=[5, 4, 3, 2, 1, 0])
    _fill(params, 0)
    opt.step()
    opt.step()
    return params, opt


def test_state_round_trips_through_torch_save_and_torch_sgd():
    params, opt = _two_bucketed_steps()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    theirs = torch.optim.SGD(_params(1), lr=0.5, momentum=0.9, foreach=False)
    theirs.load_state_dict(loaded)  # torch's optimizer takes this one's state
    assert theirs.param_groups[0]["lr"] == 0.1
    again = SGD(_params(1), lr=0.5, momentum=0.9)
    again.load_state_dict(theirs.state_dict())  # and the other way round
    for p, q in zip(params, again.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["momentum_buffer"], again.state[q]["momentum_buffer"])
    with pytest.raises(ValueError, match="do not match"):
        SGD(_params(1)[:3], lr=0.1).load_state_dict(loaded)


def test_parameters_and_buffers_become_views_of_the_gradient_layout():
    params, opt = _two_bucketed_steps()
    assert contiguous_runs(list(reversed(params))) == [list(range(6))]
    assert contiguous_runs([opt.state[p]["momentum_buffer"] for p in reversed(params)]) == [list(range(6))]


def test_zero_grad_and_bad_arguments():
    params = _params(2)
    opt = SGD(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    opt.step()  # no gradients: nothing moves
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=">= 0"):
        SGD(params, lr=-1.0)


def test_no_dynamo_import():
    """Building and stepping it imports no torch._dynamo (torch's optimizers do: ~70 MiB per worker)."""
    code = ("import sys, torch\nfrom algorithms.policies.optim import SGD\n"
            "p = [torch.nn.Parameter(torch.randn(4))]\no = SGD(p, lr=0.1, momentum=0.9)\n"
            "p[0].grad = torch.ones(4)\no.step()\no.load_state_dict(o.state_dict())\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False", out.stdout + out.stderr
