"""BSP on torch's C++ reducer (`sync.engine`), two real gloo ranks in threads of this process: the
same sums as the Python buckets, the vote in the last bucket, micro-steps, the epoch abort inside
backward, and the errors for what the reducer cannot run."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from actors.transport.comm import CommAborted, CommError, GroupSpec, make_communicator, serve_store
from algorithms.policies.allreduce import AllReduce, plan_reducer_buckets
from algorithms.policies.base import EpochInfo, VoteDraft
from core.schema import BSPConfig, ConfigError
from orchestrator.config import config_from_dict

TIMEOUT_S = 3.0
PER_RANK = 8


@pytest.fixture(scope="module")
def store_port():
    _server, port, sock = serve_store("127.0.0.1", TIMEOUT_S)
    yield port
    sock.close()


def _groups(port: int, name: str, n: int = 2, timeout_s: float = TIMEOUT_S):
    spec = lambda rank: GroupSpec("127.0.0.1", port, name, rank, n, timeout_s, "gloo", "127.0.0.1")  # noqa: E731
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda r: make_communicator(spec(r)), range(n)))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _data(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PER_RANK, 64, generator=g), torch.randint(0, 10, (PER_RANK,), generator=g)


def _member(engine: str, comm, rank: int, n: int = 2, bucket_mb: float = 25.0):
    model = _model()
    impl = AllReduce(BSPConfig(bucket_mb=bucket_mb, engine=engine)).bind(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    impl.on_membership(comm, EpochInfo(rank=rank, world_size=n, members=tuple(f"w{i}" for i in range(n)),
                                       global_batch=n * PER_RANK))
    return model, impl


def _step(impl, model, rank: int, step: int, n: int = 2, micro: int = 1):
    """What the worker's step loop does, for one rank: losses weighted by the share of the global batch."""
    x, y = _data(rank, step)
    draft = VoteDraft(samples=PER_RANK)
    impl.begin_step(step, draft)
    size = PER_RANK // micro
    for i in range(micro):
        impl.accumulating = i < micro - 1
        loss = nn.functional.cross_entropy(model(x[i * size:(i + 1) * size]), y[i * size:(i + 1) * size])
        weight = size / (n * PER_RANK)
        draft.loss = draft.loss + loss.detach() * weight
        impl.backward(loss * weight)
    impl.end_backward(step)
    vote = impl.finish_step(step, draft)
    impl.apply_update(step, 0.1)
    return vote


def _both_ranks(run, members, comms) -> tuple[list[torch.Tensor], list[bool]]:
    """`run(rank)` for both ranks at once, then the groups closed: each member's flat parameters, and whether
    each ran on torch's reducer."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, range(2)))
    engines = [impl.reducer is not None for _, impl in members]
    for c in comms:
        c.close()
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m, _ in members], engines


def _train(port: int, name: str, engine: str, steps: int = 3, micro: int = 1, bucket_mb: float = 25.0):
    comms = _groups(port, name)
    members = [_member(engine, c, r, bucket_mb=bucket_mb) for r, c in enumerate(comms)]
    votes = [[] for _ in members]

    def run(rank: int) -> None:
        model, impl = members[rank]
        for step in range(steps):
            votes[rank].append(_step(impl, model, rank, step, micro=micro))

    params, engines = _both_ranks(run, members, comms)
    return params, votes, engines


@pytest.mark.parametrize("bucket_mb", [25.0, 0.004])
def test_the_reducer_sums_exactly_as_the_python_buckets_and_carries_the_vote(store_port, bucket_mb):
    tag = str(bucket_mb).replace(".", "")
    reduced, votes, engines = _train(store_port, f"reducer-{tag}/e1", "reducer", bucket_mb=bucket_mb)
    python, python_votes, python_engines = _train(store_port, f"python-{tag}/e1", "python", bucket_mb=bucket_mb)
    assert engines == [True, True] and python_engines == [False, False]
    assert torch.equal(reduced[0], reduced[1]), "the replicas differ after committed steps"
    diff = float((reduced[0] - python[0]).abs().max())
    print(f"bucket_mb {bucket_mb}: reducer vs python buckets max abs diff {diff:.2e}")
    assert diff == 0.0
    for step in range(3):
        assert votes[0][step] == votes[1][step] == python_votes[0][step]
        assert votes[0][step].samples == 2 * PER_RANK and votes[0][step].commit


def test_auto_takes_the_reducer_on_gloo_and_the_python_buckets_without_a_process_group(store_port):
    from testkit.harness import LoopbackComm

    _, _, engines = _train(store_port, "auto/e1", "auto", steps=1)
    assert engines == [True, True]
    model = _model()
    impl = AllReduce(BSPConfig(engine="auto")).bind(model, torch.optim.SGD(model.parameters(), lr=0.1))
    impl.on_membership(LoopbackComm(), EpochInfo(rank=0, world_size=1, members=("w0",), global_batch=8))
    assert impl.reducer is None


def test_gradients_ready_fires_once_per_step_after_the_last_micro_step(store_port):
    comms = _groups(store_port, "ready/e1", n=1)
    model, impl = _member("reducer", comms[0], 0, n=1)
    fired = []
    impl.on_gradients_ready = lambda: fired.append(impl.accumulating)
    for step in range(3):
        _step(impl, model, 0, step, n=1, micro=4)
    comms[0].close()
    assert fired == [False, False, False]


def _train_with_a_step_metric(port: int, name: str, engine: str, steps: int = 2):
    """As `_train`, with the worker's step metrics: the loss's first call says there is one (the mean label),
    once the epoch's group and vote were built; the vote is refit for it before the first backward."""
    comms = _groups(port, name)
    members = [_member(engine, c, r) for r, c in enumerate(comms)]
    votes: list[list] = [[] for _ in members]

    def run(rank: int) -> None:
        model, impl = members[rank]
        for step in range(steps):
            x, y = _data(rank, step)
            draft = VoteDraft(samples=PER_RANK)
            impl.begin_step(step, draft)
            loss = nn.functional.cross_entropy(model(x), y)
            if step == 0:
                impl.vote_extras = 1
                impl.refit_vote()
            weight = PER_RANK / (2 * PER_RANK)
            draft.loss, draft.extras = loss.detach() * weight, (y.float().mean() * weight,)
            impl.backward(loss * weight)
            impl.end_backward(step)
            votes[rank].append(impl.finish_step(step, draft))
            impl.apply_update(step, 0.1)

    params, engines = _both_ranks(run, members, comms)
    return params, votes, engines


def test_a_step_metric_learned_at_the_first_loss_rides_the_vote_of_either_engine(store_port):
    """The reducer's vote leaf (and the Python buckets' tail room) is rebuilt wider at the first loss: the
    vote then carries the sum of the members' weighted metrics (the global batch's mean label), and the
    gradients sum as before."""
    reduced, votes, engines = _train_with_a_step_metric(store_port, "metric-reducer/e1", "reducer")
    python, python_votes, python_engines = _train_with_a_step_metric(store_port, "metric-python/e1", "python")
    assert engines == [True, True] and python_engines == [False, False]
    assert float((reduced[0] - python[0]).abs().max()) == 0.0
    for step in range(2):
        labels = torch.cat([_data(rank, step)[1] for rank in range(2)]).float()
        for vote in (votes[0][step], votes[1][step], python_votes[0][step]):
            assert vote.samples == 2 * PER_RANK and vote.extras == pytest.approx((float(labels.mean()),), abs=1e-6)


def test_micro_steps_accumulate_and_reduce_once(store_port):
    whole, _, _ = _train(store_port, "micro1/e1", "reducer", micro=1)
    split, _, _ = _train(store_port, "micro4/e1", "reducer", micro=4)
    diff = float((whole[0] - split[0]).abs().max())
    print(f"4 micro-steps vs the whole batch: max abs diff {diff:.2e}")
    assert diff < 1e-6


def _silent_peer(port: int, name: str, abort: bool, before_abort=None) -> tuple[BaseException, float]:
    """Rank 1 formed the group but never runs its backward; rank 0 waits inside backward (in the
    reducer's C++ wait on its last bucket) until the abort, or the group's timeout, releases it. With the
    abort, the group's timeout is 60 s: only the abort releases it within the test's 30 s.
    `before_abort(comm)`: called on rank 0's group once it is lent to torch, before its backward."""
    comms = _groups(port, name, timeout_s=60.0 if abort else TIMEOUT_S)
    model, impl = _member("reducer", comms[0], 0)
    if before_abort is not None:
        before_abort(comms[0])
    outcome: dict = {}
    waiting = threading.Event()

    def gradients_ready() -> None:
        outcome.setdefault("gradients", time.monotonic())
        waiting.set()
    impl.on_gradients_ready = gradients_ready

    def run() -> None:
        try:
            _step(impl, model, 0, 0)
            outcome["error"] = None
        except Exception as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    # the backward's gradients are ready: its reducer now waits for the peer (the wait must count as
    # communication, not compute)
    assert waiting.wait(30), "the backward never reached the reducer's wait"
    assert thread.is_alive(), "rank 0's backward returned while its peer never reduced"
    sent = time.monotonic()
    if abort:
        comms[0].abort("peer w1 is gone")
    thread.join(30)
    assert not thread.is_alive(), "rank 0's backward is still waiting 30 s later"
    for c in comms:
        c.close()
    return outcome["error"], outcome["at"] - sent


def test_an_abort_releases_a_backward_stuck_in_the_reducer(store_port):
    error, after = _silent_peer(store_port, "silent-abort/e1", abort=True)
    print(f"released {after:.3f}s after the abort: {type(error).__name__}: {error}")
    assert isinstance(error, CommAborted)


def test_a_settled_groups_abort_shuts_its_pairs_down_without_looking_through_the_descriptors(store_port, monkeypatch):
    """Once its first step committed, a group holds a duplicate of each of its pairs (`settled`): an abort
    on the re-form's path then shuts them down at once, without the scan of the process's descriptors
    (actors/transport/sockets.py). Here the scan is made to fail after `settled`: the abort still
    releases the backward. Without `settled` the abort would need the scan, and fail."""
    from actors.transport import sockets

    def settle(comm) -> None:
        comm.settled()
        deadline = time.monotonic() + 30
        while comm._held is None and time.monotonic() < deadline:  # the helper thread found them
            time.sleep(0.01)
        assert comm._held, "the group's pairs were not found ahead"

        def no_scan():
            raise AssertionError("the abort looked through the descriptors")
        monkeypatch.setattr(sockets, "_socket_fds", no_scan)
    error, after = _silent_peer(store_port, "silent-settled/e1", abort=True, before_abort=settle)
    monkeypatch.undo()
    print(f"released {after:.3f}s after the abort: {type(error).__name__}: {error}")
    assert isinstance(error, CommAborted)


def test_without_the_abort_the_backward_waits_for_the_group_timeout(store_port):
    """The control case: nothing but gloo's own timeout frees it (so the test above measures the abort)."""
    error, after = _silent_peer(store_port, "silent-noabort/e1", abort=False)
    print(f"no abort: released {after:.2f}s after the abort would have been sent: {type(error).__name__}")
    assert isinstance(error, CommError) and not isinstance(error, CommAborted)
    assert after >= TIMEOUT_S - 0.5 - 0.3


def test_a_parameter_without_a_gradient_is_a_clear_error(store_port):
    comms = _groups(store_port, "unused/e1", n=1)
    model = nn.ModuleDict({"used": nn.Linear(4, 2), "unused": nn.Linear(4, 2)})
    impl = AllReduce(BSPConfig(engine="reducer")).bind(model, torch.optim.SGD(model.parameters(), lr=0.1))
    impl.on_membership(comms[0], EpochInfo(rank=0, world_size=1, members=("w0",), global_batch=4))
    draft = VoteDraft(samples=4)
    impl.begin_step(0, draft)
    impl.backward(model["used"](torch.randn(4, 4)).sum())
    with pytest.raises(RuntimeError, match="engine: python"):
        impl.finish_step(0, draft)
    comms[0].close()


def test_the_last_bucket_is_small_and_first_parameters_go_last():
    f32 = torch.float32
    plan = plan_reducer_buckets([(100, f32), (300_000, f32), (10, f32), (2**20, f32), (5, torch.float16)], 25 * 2**20)
    assert plan.buckets == ((4,), (1, 2, 3), (0,))
    assert plan_reducer_buckets([(10, f32)] * 3, 25 * 2**20).buckets == ((0, 1, 2),)


def _cfg(**sync) -> dict:
    return {"name": "engine", "workload": {"factory": "orchestrator.workloads.digits:mlp"},
            "stop": {"max_steps": 10}, "sync": {"policy": "bsp", **sync}}


def test_the_reducer_engine_refuses_codecs_and_gpus_shared_over_gloo():
    with pytest.raises(ConfigError, match="sync.engine: the reducer sends plain gradients"):
        config_from_dict({**_cfg(engine="reducer"), "compression": {"codec": "uint8"}})
    with pytest.raises(ConfigError, match="sync.engine: the reducer runs on gloo with CPU parameters or on NCCL"):
        config_from_dict({**_cfg(engine="reducer"), "workers": {"count": 2, "gpus": 0.5}, "comm": {"backend": "gloo"}})
    with pytest.raises(ConfigError, match="sync.engine: the reducer runs on gloo"):
        config_from_dict({**_cfg(engine="reducer"), "workers": {"count": 1, "gpus": 1}, "comm": {"backend": "gloo"}})
    assert config_from_dict({**_cfg(engine="reducer"), "workers": {"count": 1, "gpus": 1}}).sync.engine == "reducer"
    with pytest.raises(ConfigError, match="sync.engine"):
        config_from_dict(_cfg(engine="fast"))
    assert config_from_dict(_cfg()).sync.engine == "auto"
