"""Periodic rounds through the compressed scatter-gather (`compression.codec` with `local_sgd`,
`diloco`, `streaming_diloco`): replicas in process against the plain-torch periodic reference whose
rounds sum their payloads with the literal scatter-gather reference; error-feedback residuals of a
round kept only when it commits; which policies the config lets compress."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from algorithms.policies.base import EpochInfo, VoteDraft, get_algorithm
from core.schema import ASPConfig, CompressionConfig, ConfigError, FieldError, JobConfig, LocalSGDConfig, WorkloadConfig
from orchestrator.config import config_from_dict
from testkit.harness import local_group
from tests.unit.test_policy_oracles import OUTER, SGD_M, config, flat, max_diff, reference_periodic, run_replicas, set_flat

N, GLOBAL_BATCH = 3, 50  # shares of 17, 17 and 16: unequal round weights


def run(tmp_path, sync: dict, compression: dict, steps: int) -> list[torch.Tensor]:
    cfg = dict(config(sync, SGD_M, steps, N), compression=compression)
    return run_replicas(tmp_path, cfg, N, GLOBAL_BATCH)


# ------------------------------------------------------------------ against the references
def test_local_sgd_uint8_equals_the_literal_scatter_gather_reference(tmp_path):
    mine = run(tmp_path, {"policy": "local_sgd", "h": 2}, {"codec": "uint8"}, steps=6)
    diff = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=2, steps=6, codec="uint8"))
    uncompressed = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=2, steps=6))
    print(f"local_sgd h=2 + uint8 (3 rounds) vs reference: {diff:.2e}; vs uncompressed: {uncompressed:.2e}")
    assert diff < 1e-6
    assert uncompressed > 1e-3, "the rounds must travel compressed"


def test_local_sgd_fp16_stays_within_fp16_rounding_of_uncompressed(tmp_path):
    """A round's mean rounds each weighted replica once and each owner's sum once: about 2 * 2**-11
    relative to the parameters (|x| < 1 here); the local steps between rounds barely amplify it."""
    mine = run(tmp_path, {"policy": "local_sgd", "h": 2}, {"codec": "fp16"}, steps=6)
    literal = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=2, steps=6, codec="fp16"))
    diff = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=2, steps=6))
    print(f"local_sgd h=2 + fp16 (3 rounds) vs uncompressed reference: {diff:.2e}; vs literal: {literal:.2e}")
    assert literal < 1e-6
    assert 1e-6 < diff < 3 * 2.0 ** -11


def test_diloco_outer_step_consumes_the_decoded_mean_pseudo_gradient(tmp_path):
    """uint8 with error feedback: the outer Nesterov step takes the scatter-gather's decoded SUM of the
    weighted pseudo-gradients over the samples, and each round's residuals carry into the next."""
    mine = run(tmp_path, {"policy": "diloco", "h": 2}, {"codec": "uint8", "feedback": True}, steps=8)
    diff = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=2, steps=8, outer=OUTER,
                                             codec="uint8", feedback=True))
    without_feedback = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=2, steps=8, outer=OUTER,
                                                         codec="uint8"))
    print(f"diloco h=2 + uint8 with feedback (4 rounds) vs reference: {diff:.2e}; "
          f"vs the reference without feedback: {without_feedback:.2e}")
    assert diff < 1e-6
    assert without_feedback > 1e-5, "the residuals must carry into the next round"


@pytest.mark.parametrize("overlap,alpha,feedback", [(0, 1.0, True), (1, 0.5, False)])
def test_streaming_diloco_compresses_each_fragment_round(tmp_path, overlap, alpha, feedback):
    """Each fragment's rounds go through a scatter-gather of their own (own residuals with feedback).
    Feedback is compared without overlap only: with overlap the implementation counts a fragment's
    next round's samples from its merge, the reference from its launch; the weights' ratios agree, but
    the payload's scale, to which the carried residual is added, does not."""
    streaming = {"policy": "streaming_diloco", "h": 4, "fragments": 2, "overlap": overlap, "alpha": alpha}
    mine = run(tmp_path, streaming, {"codec": "uint8", "feedback": feedback}, steps=12)
    diff = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=4, steps=12, outer=OUTER, fragments=2,
                                             overlap=overlap, alpha=alpha, codec="uint8", feedback=feedback))
    uncompressed = max_diff(mine, reference_periodic(SGD_M, N, GLOBAL_BATCH, h=4, steps=12, outer=OUTER, fragments=2,
                                                     overlap=overlap, alpha=alpha))
    print(f"streaming 2 fragments, overlap {overlap} + uint8, feedback {feedback} (12 steps) vs reference: "
          f"{diff:.2e}; vs uncompressed: {uncompressed:.2e}")
    assert diff < 1e-6
    assert uncompressed > 1e-4, "the rounds must travel compressed"


# ------------------------------------------------------------------ residuals and rounds
NUMEL = (6 + 1) * 5  # nn.Linear(6, 5): one fragment of 35 elements, chunks of 12 over 3 members


def _member(comm, members: int, start: torch.Tensor):
    """A local_sgd (h = 1) member whose rounds travel in uint8 with error feedback, at `start`."""
    model = torch.nn.Linear(6, 5)
    set_flat(list(model.parameters()), start)
    algorithm = get_algorithm("local_sgd")(LocalSGDConfig(h=1), CompressionConfig("uint8", feedback=True))
    impl = algorithm.bind(model, torch.optim.SGD(model.parameters(), lr=0.1))
    impl.on_membership(comm, EpochInfo(comm.rank, members, tuple(f"w{r}" for r in range(members)), 30))
    return impl


def _round(impl, step: int, delta: torch.Tensor, samples: int):
    """One local step that moved the replica by `delta`, then the round after it (merged: h = 1)."""
    with torch.no_grad():
        for p, d in zip(impl.params, delta.split([p.numel() for p in impl.params])):
            p.add_(d.view_as(p))
    impl.finish_step(step - 1, VoteDraft(loss=1.0, samples=samples))
    assert impl.sync_due(step, None)
    return impl.sync(step, VoteDraft())


def _residuals(impl) -> tuple:
    wire = impl.wires[0]
    return wire.worker_feedback.residual, wire.owner_feedback.residual


def _on_group(comms, work) -> list:
    with ThreadPoolExecutor(len(comms)) as pool:
        return list(pool.map(work, comms))


def test_a_round_whose_vote_fails_keeps_no_residuals():
    """A round's vote is lost after its scatter-gather (on every member here): each member discards the
    round, takes its committed state back and redoes the round. Nothing of the lost round stays: the
    residuals and the result equal those of members that only ever ran the redone round, and those
    residuals are not empty (feedback is on)."""
    gen = torch.Generator().manual_seed(5)
    start, lost, redone = (torch.randn(N, NUMEL, generator=gen) for _ in range(3))

    def work(comm):
        rank = comm.rank
        retried, clean = _member(comm, N, start[rank]), _member(comm, N, start[rank])
        before = retried.state_dict()
        vote = _round(retried, 1, lost[rank], samples=10 + rank)
        assert vote.commit and vote.samples == 33
        retried.discard(1)
        after_discard = _residuals(retried)
        set_flat(retried.params, start[rank])
        retried.load_state_dict(before)
        for impl in (retried, clean):
            _round(impl, 1, redone[rank], samples=10 + rank)
            impl.commit(1)
        return after_discard, retried, clean

    for (worker, owner), retried, clean in _on_group(local_group(N), work):
        assert worker is None and owner is None, "a discarded round's residuals were kept"
        assert torch.equal(flat(retried.params), flat(clean.params))
        for kept, expected in zip(_residuals(retried), _residuals(clean)):
            assert expected is not None and torch.equal(kept, expected)


def test_a_new_membership_resets_owner_residuals_and_rounds_go_on_over_the_new_group():
    gen = torch.Generator().manual_seed(6)
    start, first, second = (torch.randn(N, NUMEL, generator=gen) for _ in range(3))
    members = _on_group(local_group(N), lambda comm: _member(comm, N, start[comm.rank]))

    def first_round(comm):
        impl = members[comm.rank]
        _round(impl, 1, first[comm.rank], samples=10)
        impl.commit(1)
        return _residuals(impl)[0].clone()

    workers = _on_group([impl.comm for impl in members], first_round)
    survivors = members[:2]  # w2 left

    def next_epoch(comm):
        impl = survivors[comm.rank]
        impl.on_membership(comm, EpochInfo(comm.rank, 2, ("w0", "w1"), 30, membership_epoch=1))
        worker, owner = _residuals(impl)
        assert owner is None and torch.equal(worker, workers[comm.rank])
        return _round(impl, 2, second[comm.rank], samples=10 + comm.rank)

    votes = _on_group(local_group(2, name="next epoch"), next_epoch)
    assert [vote.samples for vote in votes] == [21, 21]


# ------------------------------------------------------------------ the config
MINIMAL = {"name": "m", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 3}}


@pytest.mark.parametrize("policy", ["local_sgd", "diloco", "streaming_diloco"])
def test_periodic_policies_take_a_codec(policy):
    cfg = config_from_dict(dict(MINIMAL, sync={"policy": policy}, compression={"codec": "uint8"}))
    assert cfg.sync.policy == policy and cfg.compression.codec == "uint8"


def test_a_policy_that_does_not_compress_refuses_a_codec_naming_the_key():
    with pytest.raises(FieldError) as err:
        JobConfig(name="m", workload=WorkloadConfig(MINIMAL["workload"]["factory"]), sync=ASPConfig(),
                  compression=CompressionConfig("uint8"))
    assert err.value.field_name == "compression.codec"
    with pytest.raises(ConfigError) as err:
        config_from_dict(dict(MINIMAL, sync={"policy": "asp"}, compression={"codec": "uint8"}))
    text = str(err.value)
    assert text == ("compression.codec: policy 'asp' does not compress yet; "
                    "bsp, bytegrad, qadam, local_sgd, diloco, streaming_diloco, dpsgd, dadam, choco do"), text
