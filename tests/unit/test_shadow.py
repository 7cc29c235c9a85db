"""Shadow synchronization (algorithms/policies/shadow.py) in one process: members are gloo groups in threads
over a HashStore (`local_group`), no Ray. Oracles are plain-torch references of the rules."""
from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from algorithms.policies.shadow_sync import BackgroundSync, Lifecycle, LocalCentral
from core.schema import FieldError, ShadowConfig
from testkit.harness import local_group

N = 3


def replica(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return list(torch.nn.Linear(7, 5).parameters())


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def step_of(seed: int, params) -> list[torch.Tensor]:
    """A known 'foreground step': a fixed perturbation per parameter."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) * 0.1 for p in params]


def take_step(sync: BackgroundSync, params, seed: int) -> torch.Tensor:
    with sync.foreground(), torch.no_grad():
        steps = step_of(seed, params)
        for p, s in zip(params, steps):
            p.add_(s)
    return torch.cat([s.reshape(-1) for s in steps])


def run_rounds(syncs, comms, rounds: int = 1) -> None:
    """Every member runs `rounds` rounds with its foreground held; wait for them all."""
    for sync, comm in zip(syncs, comms):
        sync.start(comm, max_rounds=rounds)
    for sync in syncs:
        sync.thread.join(20)
        assert not sync.thread.is_alive()
        assert sync.state == Lifecycle.STOPPED


def members(config: ShadowConfig, seeds=range(N), **kw):
    params = [replica(s) for s in seeds]
    return params, [BackgroundSync(p, config, **kw) for p in params]


def test_ma_with_the_foreground_held_is_the_exact_average():
    params, syncs = members(ShadowConfig(method="ma"))
    before = torch.stack([flat(p) for p in params])
    comms = local_group(N, "ma")
    with syncs[0].hold_foreground(), syncs[1].hold_foreground(), syncs[2].hold_foreground():
        run_rounds(syncs, comms)
    avg = before.mean(0)
    # through shared memory (one process: one node) a member writes its tensor once; gloo's ring sends 2(n-1)/n of it
    sent = avg.numel() * 4 if comms[0].shared_memory else 2 * (N - 1) * avg.numel() * 4 // N
    for p, s in zip(params, syncs):
        assert (flat(p) - avg).abs().max() <= 1e-6
        assert s.stats.rounds_completed == 1 and s.stats.rounds_failed == 0
        assert s.stats.bytes_sent == sent


def test_foreground_steps_taken_during_a_round_are_kept():
    """Member 0's foreground takes one whole step between the snapshot and the all-reduce, and is in
    the middle of a second (holding the lock, a read-modify-write) when the round wants to write back:
    x = avg + (x_after_steps - snapshot)."""
    params = [replica(s) for s in range(N)]
    before = torch.stack([flat(p) for p in params])
    progress = {}
    in_step = threading.Event()

    def slow_step() -> None:
        with syncs[0].foreground(), torch.no_grad():
            seen = [p.detach().clone() for p in params[0]]
            in_step.set()
            lock, deadline = syncs[0].lock, time.monotonic() + 30
            while lock._next - lock._serving < 2:  # the round now waits for this step's lock to write back
                assert time.monotonic() < deadline, "the round never came to its write-back"
                time.sleep(0.005)
            steps = step_of(2, params[0])
            for p, v, s in zip(params[0], seen, steps):
                p.copy_(v + s)
        progress["second"] = torch.cat([s.reshape(-1) for s in steps])

    fg = threading.Thread(target=slow_step)

    def hook(phase: str, index: int) -> None:
        if phase == "snapshot":
            progress["first"] = take_step(syncs[0], params[0], 1)
        else:
            fg.start()
            in_step.wait(5)

    syncs = [BackgroundSync(p, ShadowConfig(method="ma"), hook=hook if r == 0 else None)
             for r, p in enumerate(params)]
    run_rounds(syncs, local_group(N, "interleave"))
    fg.join(5)
    avg = before.mean(0)
    assert (flat(params[0]) - (avg + progress["first"] + progress["second"])).abs().max() <= 1e-6
    for p in params[1:]:
        assert (flat(p) - avg).abs().max() <= 1e-6


def test_bmuf_without_momentum_and_unit_block_lr_is_ma():
    ma_params, ma = members(ShadowConfig(method="ma"))
    bmuf_params, bmuf = members(ShadowConfig(method="bmuf", block_momentum=0.0, block_lr=1.0), seeds=range(10, 10 + N))
    for mine, theirs in zip(bmuf_params, ma_params):  # same replicas, but x_g starts elsewhere
        with torch.no_grad():
            for p, q in zip(mine, theirs):
                p.copy_(q)
    run_rounds(ma, local_group(N, "ma2"))
    run_rounds(bmuf, local_group(N, "bmuf0"))
    for p, q in zip(bmuf_params, ma_params):
        assert (flat(p) - flat(q)).abs().max() <= 1e-6


def test_bmuf_with_block_momentum_matches_a_plain_torch_reference_over_three_rounds():
    eta, zeta = 0.6, 0.8
    params, syncs = members(ShadowConfig(method="bmuf", block_momentum=eta, block_lr=zeta), seeds=[0] * N)
    comms = local_group(N, "bmuf")
    x = [flat(p) for p in params]
    x_g, delta = x[0].clone(), torch.zeros_like(x[0])
    for r in range(3):
        for i in range(N):
            x[i] = x[i] + take_step(syncs[i], params[i], 100 * r + i)
        run_rounds(syncs, comms)
        avg = torch.stack(x).mean(0)
        delta = eta * delta + zeta * (avg - x_g)
        x_g = x_g + delta
        x = [x_g.clone() for _ in range(N)]
        for p in params:
            assert (flat(p) - x_g).abs().max() <= 1e-6
    for s in syncs:
        assert (s.global_copy - x_g).abs().max() <= 1e-6 and (s.block_step - delta).abs().max() <= 1e-6


def test_easgd_matches_a_plain_torch_reference_over_three_rounds():
    alpha = 0.3
    params = [replica(s) for s in range(N)]
    c = replica(99)
    central = LocalCentral(flat(c))
    syncs = [BackgroundSync(p, ShadowConfig(method="easgd", alpha=alpha), central=central) for p in params]
    x, ref_c = [flat(p) for p in params], flat(c)
    for r in range(3):
        for i in range(N):  # one member at a time, so the central copy sees a known order
            x[i] = x[i] + take_step(syncs[i], params[i], 10 * r + i)
            run_rounds([syncs[i]], [None])
            pull = alpha * (x[i] - ref_c)
            x[i], ref_c = x[i] - pull, ref_c + pull
    for p, ref in zip(params, x):
        assert (flat(p) - ref).abs().max() <= 1e-6
    assert (central.value - ref_c).abs().max() <= 1e-6


class AbortsMidRound:
    """A member whose communicator is aborted as its round's all-reduce launches (it never arrives)."""

    def __init__(self, inner) -> None:
        self.inner, self.world_size = inner, inner.world_size

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    def all_reduce(self, tensor, op="sum"):
        self.inner.abort("member gone mid-round")
        return self.inner.all_reduce(tensor, op)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)


def test_a_failed_round_writes_nothing_back_on_any_member_and_is_counted():
    params, syncs = members(ShadowConfig(method="ma"), timeout_s=1.0)
    before = [flat(p) for p in params]
    comms = local_group(N, "fail", timeout_s=1.0)
    comms[2] = AbortsMidRound(comms[2])
    run_rounds(syncs, comms)
    for p, b, s in zip(params, before, syncs):
        assert torch.equal(flat(p), b)
        assert s.stats.rounds_failed == 1 and s.stats.rounds_completed == 0 and s.stats.last_error


class StuckHandle:
    """A collective stuck in the backend: abort does not free it; only the test's release does, and
    then it even reports success."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def wait(self, timeout=None) -> None:
        self.release.wait(30)


class StuckComm(AbortsMidRound):
    def __init__(self, inner, release: threading.Event) -> None:
        super().__init__(inner)
        self.release = release

    def all_reduce(self, tensor, op="sum"):
        self.inner.all_reduce(tensor, op)  # the peer never arrives
        return StuckHandle(self.release)


def test_abandon_returns_at_once_and_never_joins_a_thread_stuck_in_a_collective():
    inside, release = threading.Event(), threading.Event()
    params = replica(0)
    before = flat(params)
    sync = BackgroundSync(params, ShadowConfig(method="ma"), hook=lambda phase, i: inside.set())
    comm = local_group(2, "stuck", timeout_s=3.0)[0]
    sync.start(StuckComm(comm, release))
    assert inside.wait(5)
    time.sleep(0.05)
    # the collective stays stuck until the test releases it, after abandon: an abandon that joined
    # the round's thread would never return (the bound is 10 s; it returns in microseconds)
    began = time.perf_counter()
    assert sync.abandon("peer lost") == Lifecycle.ABANDONED
    elapsed = time.perf_counter() - began
    assert elapsed < 10.0, elapsed
    assert sync.thread.is_alive()  # left stuck, not joined
    assert comm.aborted
    release.set()  # the collective "succeeds" after all: the abandoned round must not write back
    sync.thread.join(5)
    assert torch.equal(flat(params), before)
    assert sync.stats.rounds_completed == 0 and sync.stats.rounds_failed == 1
    assert sync.state == Lifecycle.ABANDONED


def test_an_abandoned_epoch_frees_the_thread_and_the_group_re_forms_without_the_dead_member():
    """Member 2 dies before its round: the others block in the all-reduce until the epoch is abandoned
    (the abort frees a gloo wait at once); the next epoch's group of two averages them."""
    params, syncs = members(ShadowConfig(method="ma"))
    before = torch.stack([flat(p) for p in params])
    first = local_group(N, "epoch1", timeout_s=120.0)  # only the abort frees the wait within the test
    for sync, comm in zip(syncs[:2], first[:2]):
        sync.start(comm)
    with pytest.raises(RuntimeError):
        syncs[0].start(first[0])
    for sync in syncs[:2]:
        assert sync.abandon("member 2 died") == Lifecycle.ABANDONED
    for sync in syncs[:2]:
        sync.thread.join(30)
        assert not sync.thread.is_alive(), "the abort did not free the round's thread"
    assert [s.stats.rounds_failed for s in syncs[:2]] == [1, 1]
    for p, b in zip(params[:2], before[:2]):
        assert torch.equal(flat(p), b)
    run_rounds(syncs[:2], local_group(2, "epoch2"))
    for p in params[:2]:
        assert (flat(p) - before[:2].mean(0)).abs().max() <= 1e-6


class SlowComm(AbortsMidRound):
    """Every collective pays a fixed latency (a slow network)."""

    def __init__(self, inner, latency_s: float) -> None:
        super().__init__(inner)
        self.latency_s = latency_s

    def all_reduce(self, tensor, op="sum"):
        time.sleep(self.latency_s)
        return self.inner.all_reduce(tensor, op)


def foreground_loop(sync: BackgroundSync, params, seconds: float, counts: list, index: int) -> None:
    """Small steps under the lock: 4 ms of modelled compute and an update."""
    update = [torch.full(p.shape, 1e-4) for p in params]
    end, steps = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        with sync.foreground(), torch.no_grad():
            time.sleep(0.004)
            for p, u in zip(params, update):
                p.sub_(u)
        steps += 1
    counts[index] = steps


def run_foregrounds(syncs, params, seconds: float) -> int:
    counts = [0] * len(syncs)
    threads = [threading.Thread(target=foreground_loop, args=(s, p, seconds, counts, i))
               for i, (s, p) in enumerate(zip(syncs, params))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def synced_window(syncs, params, seconds: float, latency: float, name: str) -> tuple[int, list, list, float]:
    """One window with background sync over a fresh, slow group: (foreground steps, rounds completed
    and failed per member within the window, the most any foreground waited for the lock)."""
    counted = [(s.stats.rounds_completed, s.stats.rounds_failed, s.stats.foreground_blocked_s) for s in syncs]
    for sync, comm in zip(syncs, local_group(len(syncs), name)):
        sync.start(SlowComm(comm, latency))
    steps = run_foregrounds(syncs, params, seconds)
    rounds = [s.stats.rounds_completed - c[0] for s, c in zip(syncs, counted)]
    failed = [s.stats.rounds_failed - c[1] for s, c in zip(syncs, counted)]
    blocked = max(s.stats.foreground_blocked_s - c[2] for s, c in zip(syncs, counted))
    for sync in syncs:
        sync.request_stop()
    for sync in syncs:  # a member may have begun a round its peers will not join: it is abandoned
        sync.stop(timeout=0.3)
    for sync in syncs:  # the abort frees an abandoned thread at once; let it count its failure now
        sync.thread.join(2)
    return steps, rounds, failed, blocked


class ForegroundProbe(AbortsMidRound):
    """In every collective of a round, another thread takes the foreground lock and lets it go: it
    succeeds only if the round does not hold the lock while its collective is in flight."""

    def __init__(self, inner, sync: BackgroundSync, outcomes: list) -> None:
        super().__init__(inner)
        self.sync, self.outcomes = sync, outcomes

    def all_reduce(self, tensor, op="sum"):
        def step() -> None:
            with self.sync.foreground():
                pass
        stepper = threading.Thread(target=step, daemon=True)
        stepper.start()
        stepper.join(30)
        self.outcomes.append(not stepper.is_alive())
        return self.inner.all_reduce(tensor, op)


def test_a_foreground_step_runs_while_a_round_s_collective_is_in_flight():
    """The mechanism that keeps the foreground's pace (its rate beside a slow background is a figure of
    the slow test below and of benchmarks/shadow_scaling.py): a round holds the foreground lock only to
    copy and to write back, never during its collectives."""
    params, syncs = members(ShadowConfig(method="ma"))
    outcomes: list = []
    for sync, comm in zip(syncs, local_group(N, "probe")):
        sync.start(ForegroundProbe(comm, sync, outcomes), max_rounds=2)
    for sync in syncs:
        sync.thread.join(60)
        assert not sync.thread.is_alive() and sync.state == Lifecycle.STOPPED
    assert outcomes and all(outcomes), f"a foreground step waited for a round's collective: {outcomes}"
    assert all(s.stats.rounds_completed == 2 for s in syncs)


@pytest.mark.slow  # a rate ratio: a figure, reported here and by benchmarks/shadow_scaling.py
def test_the_foreground_never_waits_for_a_slow_background(record_property):
    """Windows without and with background sync alternate, A B B A ..., so that load from elsewhere on
    the machine weighs on both alike; each window with sync has a fresh group whose every collective
    is slow. Rounds run every `interval`; the expected count is window / interval. The rate ratio is
    the median over the windows' pairs (a burst of load elsewhere costs one pair, not the figure);
    a foreground that waited for the slow collective would run at about 1 - latency / interval."""
    seconds, windows, interval, latency = 0.25, 8, 0.05, 0.025
    params = [list(torch.nn.Linear(256, 256).parameters()) for _ in range(N)]
    syncs = [BackgroundSync(p, ShadowConfig(method="ma", interval_s=interval)) for p in params]
    pairs = []
    rounds, failed, blocked = [0] * N, [0] * N, 0.0
    for window in range(windows):
        counted = {}
        for synced in ((False, True) if window % 2 == 0 else (True, False)):
            if not synced:
                counted[False] = run_foregrounds(syncs, params, seconds)
                continue
            steps, done, bad, waited = synced_window(syncs, params, seconds, latency, f"slow{window}")
            counted[True] = steps
            rounds = [a + b for a, b in zip(rounds, done)]
            failed = [a + b for a, b in zip(failed, bad)]
            blocked = max(blocked, waited)
        pairs.append((counted[True], counted[False]))
    expected = windows * seconds / interval
    ratios = sorted(w / a for w, a in pairs)
    ratio, fraction = statistics.median(ratios), min(rounds) / expected
    record_property("foreground_ratio", ratio)
    record_property("rounds_fraction", fraction)
    print(f"foreground rate ratio {ratio:.3f} (median of {windows} window pairs: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; {sum(w for w, _ in pairs)} vs {sum(a for _, a in pairs)} steps), "
          f"rounds {rounds} of {expected:.0f} expected (min fraction {fraction:.2f}), most blocked "
          f"{blocked:.4f} s in a {seconds:g} s window with sync")
    assert ratio >= 0.9
    assert fraction >= 0.8
    assert failed == [0] * N


def test_settings_are_checked():
    with pytest.raises(FieldError):
        ShadowConfig(method="gossip")
    with pytest.raises(FieldError):
        ShadowConfig(block_momentum=1.0)
    with pytest.raises(ValueError):
        BackgroundSync(replica(0), ShadowConfig(method="easgd"))
