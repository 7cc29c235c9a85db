"""The compressed scatter-gather all-reduce on in-process gloo groups: against an uncompressed
all-reduce, against a plain-torch reference (exactly), the vote tail, failures, bytes on the wire."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from actors.transport.comm import CommError
from algorithms.policies.compression import CODECS, Codec, get_codec
from algorithms.policies.scatter_gather import ScatterGather
from testkit.harness import local_group

GROUPS = [(2, 7), (3, 1001), (4, 5), (4, 1), (3, 2)]
"""(world size, elements): odd sizes, a last chunk that is partial or pure padding, one element."""


def _on_group(n: int, work: Callable[[Any], Any], timeout_s: float = 10.0) -> list[Any]:
    """Run `work(comm)` on every member of a fresh group, in threads; a raised error is returned."""
    comms = local_group(n, timeout_s=timeout_s)

    def guarded(comm):
        try:
            return work(comm)
        except Exception as err:  # noqa: BLE001 - the test inspects it
            return err

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(guarded, comms))


def _inputs(n: int, numel: int, steps: int = 1, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(numel, generator=gen) * (r + 1) + r for r in range(n)] for _ in range(steps)]


def _tails(n: int) -> list[torch.Tensor]:
    return [torch.tensor([0.1 * (r + 1), 111.0 * r + 7, float(r == n - 1)]) for r in range(n)]


def _compressed(codec: Codec, steps: list[list[torch.Tensor]], feedback: bool) -> Callable[[Any], list]:
    """Per member: the all-reduced tensor of every step (each committed) and the last tail."""
    def work(comm):
        sg = ScatterGather(codec, steps[0][0].numel(), feedback=feedback)
        sg.bind(comm)
        outputs = []
        for xs in steps:
            x = xs[comm.rank].clone()
            tail = sg.all_reduce(x, _tails(comm.world_size)[comm.rank])
            sg.commit()
            outputs.append(x)
        return outputs, tail

    return work


def _reference(codec: Codec, steps: list[list[torch.Tensor]], feedback: bool) -> list[torch.Tensor]:
    """The scatter-gather in plain torch: pad, split, compress, decompress, sum, recompress, decompress."""
    n, d = len(steps[0]), steps[0][0].numel()
    m = -(-d // n)
    worker_residual = [torch.zeros(d) for _ in range(n)]
    owner_residual = [torch.zeros(m) for _ in range(n)]
    results = []
    for xs in steps:
        received = [[torch.empty(0)] * n for _ in range(n)]  # received[owner][sender]
        for r in range(n):
            sent = xs[r] + worker_residual[r] if feedback else xs[r]
            padded = torch.cat([sent, torch.zeros(n * m - d)])
            decoded = [codec.decompress(codec.compress(chunk), m) for chunk in padded.split(m)]
            for i in range(n):
                received[i][r] = decoded[i]
            if feedback:
                worker_residual[r] = (padded - torch.cat(decoded))[:d]
        chunks = []
        for i in range(n):
            total = torch.zeros(m)
            for r in range(n):
                total = total + received[i][r]
            if feedback:
                total = total + owner_residual[i]
            decoded = codec.decompress(codec.compress(total), m)
            if feedback:
                owner_residual[i] = total - decoded
            chunks.append(decoded)
        results.append(torch.cat(chunks)[:d])
    return results


@pytest.mark.parametrize("name,unit", [("fp16", 2.0 ** -11), ("bf16", 2.0 ** -8)])
@pytest.mark.parametrize("n,numel", GROUPS)
def test_casts_equal_an_uncompressed_all_reduce_within_their_rounding(name, unit, n, numel):
    xs = _inputs(n, numel)[0]

    def work(comm):
        plain = xs[comm.rank].clone()
        comm.all_reduce(plain).wait()
        return plain, _compressed(get_codec(name), [xs], feedback=False)(comm)[0][0]

    magnitude = sum(x.abs() for x in xs)
    for plain, compressed in _on_group(n, work):
        # Each input rounds once (unit * |x_r|), the owner's sum once more (unit * |sum|).
        bound = unit * (magnitude + plain.abs()) * (1 + unit) + 1e-6 * magnitude
        assert torch.all((compressed - plain).abs() <= bound)


@pytest.mark.parametrize("name,feedback", [("uint8", False), ("uint8", True), ("onebit", True)])
@pytest.mark.parametrize("n,numel", GROUPS)
def test_deterministic_codecs_equal_the_plain_torch_reference_exactly(name, feedback, n, numel):
    steps = _inputs(n, numel, steps=3, seed=n * 1000 + numel)
    expected = _reference(CODECS[name], steps, feedback)
    for outputs, _ in _on_group(n, _compressed(CODECS[name], steps, feedback)):
        assert all(torch.equal(got, want) for got, want in zip(outputs, expected))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_vote_tail_is_summed_exactly_on_every_rank(n):
    expected = torch.zeros(3)
    for tail in _tails(n):
        expected += tail
    results = _on_group(n, _compressed(CODECS["uint8"], _inputs(n, 9), feedback=False))
    assert all(torch.equal(tail, expected) for _, tail in results)
    assert expected[1] == sum(111 * r + 7 for r in range(n)) and expected[2] == 1


class _LeavesBeforeTheGather:
    """A member whose communicator is aborted between the all-to-all and the all-gather."""

    def __init__(self, comm) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_gather(self, outputs, tensor):
        self._comm.abort("test: the member left between the two collectives")
        return self._comm.all_gather(outputs, tensor)


def test_a_failed_all_gather_fails_the_call_everywhere_and_stages_nothing():
    n, numel = 3, 101
    xs = _inputs(n, numel)[0]
    tails = _tails(n)
    seen: dict[int, torch.Tensor | None] = {}

    def work(comm):
        sg = ScatterGather(CODECS["uint8"], numel, feedback=True)
        sg.bind(_LeavesBeforeTheGather(comm) if comm.rank == n - 1 else comm)
        try:
            return sg.all_reduce(xs[comm.rank].clone(), tails[comm.rank])
        finally:
            sg.commit()  # a failed call staged nothing: this keeps nothing
            seen[comm.rank] = sg.worker_feedback.residual

    results = _on_group(n, work, timeout_s=2.0)
    assert all(isinstance(result, CommError) for result in results), results
    assert seen == {r: None for r in range(n)}


@pytest.mark.parametrize("name,reported,goal", [("uint8", 0.2500, 0.27), ("onebit", 0.0313, 0.05)])
def test_bytes_on_the_wire_against_an_fp32_ring_all_reduce(name, reported, goal):
    n, numel = 4, 1 << 20
    codec = CODECS[name]

    def work(comm):
        sg = ScatterGather(codec, numel, feedback=codec.needs_feedback)
        sg.bind(comm)
        sg.all_reduce(torch.randn(numel), torch.zeros(3))
        return sg.bytes_sent, sg.wire_bytes()

    ring = 2 * (n - 1) / n * 4 * numel
    for measured, formula in _on_group(n, work):
        assert measured == formula
        assert measured / ring == pytest.approx(reported, abs=1e-4) and measured / ring <= goal


def test_a_discarded_step_leaves_no_trace():
    n, numel = 3, 50
    first, second = _inputs(n, numel, steps=2)

    def work(comm):
        fresh, replayed = (ScatterGather(CODECS["uint8"], numel, feedback=True) for _ in range(2))
        fresh.bind(comm)
        replayed.bind(comm)
        replayed.all_reduce(first[comm.rank].clone(), torch.zeros(3))
        replayed.discard()
        outputs = []
        for sg in (fresh, replayed):
            x = second[comm.rank].clone()
            sg.all_reduce(x, torch.zeros(3))
            outputs.append(x)
        return outputs

    for fresh, replayed in _on_group(n, work):
        assert torch.equal(fresh, replayed)


def test_a_new_membership_resets_the_owner_residual_and_keeps_the_worker_residual():
    numel = 40
    sgs = [ScatterGather(CODECS["onebit"], numel, feedback=True) for _ in range(3)]

    def step(comm):
        sg = sgs[comm.rank]
        sg.bind(comm)
        sg.all_reduce(torch.randn(numel), torch.zeros(3))
        sg.commit()
        return sg.worker_feedback.residual.clone(), sg.owner_feedback.residual

    before = _on_group(3, step)
    assert all(owner is not None and owner.numel() == 14 for _, owner in before)
    survivors = sgs[:2]  # the third member left
    for sg, comm in zip(survivors, local_group(2, name="next epoch")):
        sg.bind(comm)
    for sg, (worker, _) in zip(survivors, before):
        assert sg.owner_feedback.residual is None and torch.equal(sg.worker_feedback.residual, worker)


def test_onebit_without_error_feedback_is_refused():
    with pytest.raises(ValueError, match="needs error feedback on both halves"):
        ScatterGather(CODECS["onebit"], 10, feedback=False)
