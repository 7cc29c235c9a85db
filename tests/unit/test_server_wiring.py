"""The server policies through the real worker step loop, in process (no Ray): `LocalJob` runs real
`Replica`s in threads against a `ServerHost` (actors/server/server_host.py), so the worker side (pull a
lease, train on its samples with the loss weighted n_i / B, push), the host's lock and waits, its
`record_samples` file and its accounting are exercised exactly as the Ray actors run them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors.control.history import History
from actors.control.server_control import restart_event
from actors.server.parameter_server import make_host
from actors.server.server_host import ServerHost
from algorithms.policies.server_messages import Fence
from algorithms.rules.kinds import Reporter
from testkit.harness import LocalJob, LocalLink, LocalServerReports

N, PER_WORKER, STEPS = 3, 8, 10


def config(policy: dict, **over) -> dict:
    cfg = {"name": "wiring", "seed": 3, "workers": {"count": N, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": PER_WORKER},
           "optimizer": {"lr": 0.1, "momentum": 0.9}, "sync": policy, "stop": {"max_steps": STEPS}, "eval_every": 0}
    cfg.update(over)
    return cfg


def run(tmp_path, policy: dict, zipline: bool = True, **over) -> LocalJob:
    slots = [f"w{i}" for i in range(N)]
    job = LocalJob(config(policy, **over), slots, str(tmp_path / policy["policy"]), zipline=zipline)
    job.run(tuple(slots), N * PER_WORKER)
    return job


@pytest.mark.parametrize("policy", [{"policy": "ssp", "s": 0}, {"policy": "quorum", "k": N}, {"policy": "elastic_bsp", "r": 1}],
                         ids=["ssp0", "quorum_n", "elastic_bsp_r1"])
def test_bsp_settings_through_the_worker_loop_equal_bsp(tmp_path, policy):
    bsp = run(tmp_path, {"policy": "bsp"})
    server = run(tmp_path, policy)
    expected = torch.cat([p.reshape(-1) for p in bsp.parameters("w0")])
    got = server.server.core.parameters()
    diff = float((expected - got).abs().max())
    print(f"{policy} through the worker loop vs BSP after {STEPS} steps, n = {N}: max abs diff {diff:.1e}")
    assert diff < 1e-5, diff
    steps = [r["step"] for r in server.link.records]
    assert steps == list(range(1, STEPS + 1)), steps
    assert all(r["staleness"] == [0] * N for r in server.link.records)
    losses = [r["loss"] for r in server.link.records]
    assert np.allclose(losses, [r["loss"] for r in bsp.link.records], atol=1e-5), "the server's loss is BSP's global-batch mean"


def test_asp_with_a_straggler_applies_every_sample_once_and_accounts_for_every_lease(tmp_path):
    job = run(tmp_path, {"policy": "asp"}, stop={"max_steps": 30},
              faults={"record_samples": True, "stragglers": [{"slot": "w2", "delay_s": 0.01}]})
    lines = (tmp_path / "asp" / "samples" / "server.txt").read_text().splitlines()
    applied = [int(i) for line in lines if not line.startswith("dropped") for i in line.split()[2:]]
    counts = job.server.core.leases.counts
    assert len(applied) == len(set(applied)) == counts["applied"], "every applied sample once (one data epoch)"
    assert counts["applied"] + counts["dropped"] + counts["requeued"] == counts["leased"], counts
    assert job.server.core.leases.outstanding == 0
    versions = [int(line.split()[0]) for line in lines if not line.startswith("dropped")]
    assert sorted(set(versions)) == list(range(1, 31))
    assert all(o.ok for o in job.outcomes.values())


def test_a_push_from_a_replaced_incarnation_is_fenced_and_counted(tmp_path):
    host = ServerHost(config({"policy": "ssp", "s": 1}), str(tmp_path), LocalServerReports(LocalLink()))
    host.set_members(1, [("w0", 1), ("w1", 2)])
    old = Fence(1, "w1", 2, 0)
    pull, flat = host.pull(old, 0.1)
    assert pull.status == "ok" and flat is not None
    host.set_members(2, [("w0", 1), ("w1", 3)])  # w1 was replaced while it trained
    result = host.push(old, pull.ticket.lease_ids, pull.version, np.zeros_like(flat), 0.0)
    assert result.status == "fenced_worker"
    summary = host.summary()
    assert summary["rejected"]["fenced_worker"] == 1 and summary["version"] == 0
    assert summary["leases"]["requeued"] == pull.ticket.samples, "the replaced holder's lease went back to the queue"
    again, _ = host.pull(old, 0.05)
    assert again.status == "fenced_worker", "the old incarnation may not pull either"


def test_a_server_restart_names_the_versions_lost_and_history_records_the_redone_ones(tmp_path):
    history = History(tmp_path / "history.jsonl", Reporter.SERVER)
    for step in range(1, 8):
        history.offer({"step": step, "server_incarnation": 0})
    reason, detail = restart_event(history.written_step, 5, 1, "snap", every=5)
    assert detail["versions_lost"] == 2 and "versions 6..7 lost" in reason, reason
    history.rewind(5)
    for step in range(6, 9):
        history.offer({"step": step, "server_incarnation": 1})
    history.shut()
    lines = [(r["step"], r["server_incarnation"]) for r in map(json.loads, (tmp_path / "history.jsonl").read_text().splitlines())]
    assert lines == [(s, 0) for s in range(1, 8)] + [(s, 1) for s in range(6, 9)]
    assert restart_event(3, 3, 2, None, every=5)[1]["versions_lost"] == 0


def test_a_server_that_dies_before_reporting_versions_its_snapshot_holds_names_them_and_history_goes_on_after(tmp_path):
    """The coordinator's history at version 1 when the server, killed at 38, restarts from its snapshot at
    30 (a run under load: e2e, `faults.server`): versions 2..30 were applied, but their records died with
    the server. The event and a note name them, and history takes the redone versions from 31. (Before,
    the event said "no version lost" and history went on from 31 with 2..30 missing, unnamed.)"""
    notes = []
    history = History(tmp_path / "history.jsonl", Reporter.SERVER, note=lambda reason, detail: notes.append((reason, detail)))
    history.offer({"step": 1, "server_incarnation": 0})
    reason, detail = restart_event(history.written_step, 30, 1, "snap", every=10)
    assert detail["versions_lost"] == 0 and detail["unreported"] == [2, 30], detail
    assert "versions 2..30 are in the snapshot but were never reported" in reason, reason
    history.rewind(30)
    assert notes and notes[0][1] == {"first": 2, "last": 30} and "versions 2..30 have no history record" in notes[0][0]
    for step in range(31, 34):
        history.offer({"step": step, "server_incarnation": 1})
    history.shut()
    lines = [r["step"] for r in map(json.loads, (tmp_path / "history.jsonl").read_text().splitlines())]
    assert lines == [1, 31, 32, 33]
    assert restart_event(7, 5, 1, "snap", every=5)[1]["unreported"] is None


def test_a_new_server_resumes_from_a_stopped_jobs_checkpoint(tmp_path):
    """`--resume` for a server policy: a new server loads `model_state()`'s blob (what a stopped job's
    checkpoint holds) before any member is admitted, and takes the new run's first membership epoch."""
    job = run(tmp_path, {"policy": "ssp", "s": 1})
    blob = job.server.model_state()
    fresh = ServerHost(config({"policy": "ssp", "s": 1}, stop={"max_steps": 2 * STEPS}), str(tmp_path / "new"),
                       LocalServerReports(LocalLink()))
    assert fresh.load_checkpoint(blob) == STEPS
    assert torch.equal(fresh.core.parameters(), job.server.core.parameters())
    assert fresh.core.leases.state_dict()["cursor"] == job.server.core.leases.state_dict()["cursor"]
    fresh.set_members(1, [("w0", 1)])
    pull, flat = fresh.pull(Fence(1, "w0", 1, 0), wait_s=0.1)
    assert pull.status == "ok" and pull.version == STEPS and flat is not None
    with pytest.raises(RuntimeError, match="new server"):
        fresh.load_checkpoint(blob)


def test_a_pulled_array_is_never_rewritten_while_held_and_reused_once_released(tmp_path):
    """The server reuses its flat parameter arrays across versions; one a pull still holds (Ray may be
    serializing it) keeps its version's values."""
    host = ServerHost(config({"policy": "asp"}), str(tmp_path), LocalServerReports(LocalLink()))
    host.set_members(1, [("w0", 1)])
    fence = Fence(1, "w0", 1, 0)
    pull, held = host.pull(fence, wait_s=0.1)
    kept = held.copy()
    for _ in range(3):
        pull, flat = host.pull(fence, wait_s=0.1)
        grad = np.ones_like(flat)
        assert host.push(fence, pull.ticket.lease_ids, pull.version, grad, 1.0).status == "applied"
        del flat
    _, newest = host.pull(fence, wait_s=0.1)
    assert np.array_equal(held, kept), "a held array was rewritten"
    assert not np.array_equal(newest, kept) and newest is not held
    assert len(host._flat_pool) == 2, "a released array is reused"


@pytest.mark.parametrize("zipline", [True, False], ids=["zipline", "coordinator_silent"])
def test_elastic_bsp_barriers_through_the_worker_loop(tmp_path, zipline):
    """r = 8, w2 three times as slow (a sleep): with the coordinator's ZipLine schedules the barriers
    come where the members' predicted end times meet; with no coordinator answering, every round keeps
    the fallback (a barrier after 8 iterations) and nobody blocks. Every sample is applied once."""
    stragglers = [{"slot": f"w{i}", "delay_s": 0.01} for i in range(N - 1)] + [{"slot": f"w{N - 1}", "delay_s": 0.03}]
    job = run(tmp_path, {"policy": "elastic_bsp", "r": 8}, zipline=zipline, stop={"max_steps": 60},
              faults={"record_samples": True, "stragglers": stragglers})
    summary = job.server.summary()
    schedules = summary["schedules"]
    lines = (tmp_path / "elastic_bsp" / "samples" / "server.txt").read_text().splitlines()
    applied = [int(i) for line in lines if not line.startswith("dropped") for i in line.split()[2:]]
    counts = job.server.core.leases.counts
    assert summary["version"] == 60 and len(applied) == len(set(applied)) == counts["applied"]
    assert counts["applied"] + counts["dropped"] + counts["requeued"] == counts["leased"], counts
    barriers = [r for r in job.link.records if r.get("barrier") is not None]
    assert barriers and [r["barrier"] for r in barriers] == list(range(len(barriers)))
    print(f"elastic_bsp r=8 ({'ZipLine' if zipline else 'no coordinator'}): {len(barriers)} barriers in 60 versions, "
          f"schedules {schedules}")
    if zipline:
        assert schedules["zipline"] >= 1, schedules
    else:
        assert schedules["zipline"] == 0 and schedules["fallback"] == summary["barriers"] + 1, schedules


@pytest.mark.parametrize("policy", ["ssp", "shadow"])
def test_two_restarts_without_a_snapshot_between_take_two_incarnations(tmp_path, policy):
    """A server (or dispenser) restarted twice from the same snapshot (here: none yet) must not come back
    twice as incarnation 1: pushes addressed to the first restart's incarnation would pass the second's
    fence."""
    sync = {"policy": "ssp", "s": 1} if policy == "ssp" else {"policy": "shadow", "method": "ma"}
    hosts = [make_host(config(sync), str(tmp_path), LocalServerReports(LocalLink()), restarted=r) for r in (False, True, True)]
    incarnations = [h.core.incarnation for h in hosts]
    print(f"{policy}: incarnations {incarnations}")
    assert incarnations == [0, 1, 2]


class Wrapped:
    """A run's storage as the server opens it (`run_storage`), with the test's hooks around its calls."""

    def __init__(self, inner, before_write=None, after_look=None):
        self.inner, self.before_write, self.after_look = inner, before_write, after_look

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, data):
        if self.before_write is not None:
            self.before_write(key)
        self.inner.write(key, data)

    def read(self, key):
        try:
            return self.inner.read(key)
        finally:
            if self.after_look is not None:
                self.after_look(key)

    def list(self, prefix, recursive=True):
        try:
            return self.inner.list(prefix, recursive)
        finally:
            if self.after_look is not None:
                self.after_look(prefix)


def wrap_server_storage(monkeypatch, **hooks):
    import actors.server.server_host as server_module

    real = server_module.run_storage
    monkeypatch.setattr(server_module, "run_storage",
                        lambda setting, run_dir, *rest: (Wrapped(real(setting, run_dir, *rest)[0], **hooks),
                                                         real(setting, run_dir, *rest)[1]))


def test_a_push_that_crosses_a_snapshot_returns_while_the_snapshot_uploads(tmp_path, monkeypatch):
    """The push whose version is a multiple of `snapshot_every` answers at once; the snapshot's upload
    (held here until released) goes on in the background, and `close` waits for it."""
    import threading

    from actors.runs import checkpoints

    began, release = threading.Event(), threading.Event()

    def slow_upload(key):
        if "/checkpoints/" in key:
            began.set()
            release.wait(30)

    wrap_server_storage(monkeypatch, before_write=slow_upload)
    host = ServerHost(config({"policy": "asp"}, server={"snapshot_every": 1}), str(tmp_path / "job" / "run"),
                      LocalServerReports(LocalLink()))
    host.set_members(1, [("w0", 1)])
    fence = Fence(1, "w0", 1, 0)
    pull, flat = host.pull(fence, 1.0)
    answered, results = threading.Event(), []

    def push():
        results.append(host.push(fence, pull.ticket.lease_ids, pull.version, np.zeros_like(flat), 0.5))
        answered.set()

    threading.Thread(target=push, daemon=True).start()
    try:
        assert began.wait(30), "no snapshot was written"
        assert answered.wait(10), "the push is still waiting for its snapshot's upload"
        assert results[0].status == "applied" and results[0].version == 1, results
    finally:
        release.set()
    host.close("stopped", 30.0)
    ref = checkpoints.newest_valid(host.snapshots, pattern="checkpoints/step-*.json")
    assert ref is not None and ref.step == 1, "close did not wait for the snapshot"
    assert host.summary()["snapshot_failures"] == 0


def test_a_failed_snapshot_is_counted_and_the_next_one_is_the_retry(tmp_path, monkeypatch):
    failing = [True]

    def upload(key):
        if "/checkpoints/" in key and failing[0]:
            failing[0] = False
            raise OSError("the store is down")

    wrap_server_storage(monkeypatch, before_write=upload)
    host = ServerHost(config({"policy": "asp"}, server={"snapshot_every": 1}), str(tmp_path / "job" / "run"),
                      LocalServerReports(LocalLink()))
    host.set_members(1, [("w0", 1)])
    fence = Fence(1, "w0", 1, 0)
    for _ in range(2):
        pull, flat = host.pull(fence, 1.0)
        assert host.push(fence, pull.ticket.lease_ids, pull.version, np.zeros_like(flat), 0.5).status == "applied"
        host.wait_snapshots(10)
    host.close("stopped", 30.0)
    from actors.runs import checkpoints

    assert checkpoints.newest_valid(host.snapshots, pattern="checkpoints/step-*.json").step == 2
    assert host.summary()["snapshot_failures"] == 1


@pytest.mark.parametrize("policy", ["ssp", "shadow"])
def test_two_server_restarts_claiming_at_once_take_two_incarnations(tmp_path, monkeypatch, policy):
    """Two restarts of one run's server (a zombie's and Ray's, say) claim an incarnation at the same
    moment: the second claims between the first's look at the newest incarnation and its own claim. They
    must not both come back as incarnation 1 (on an object store, a read then a plain write claims nothing)."""
    sync = {"policy": "ssp", "s": 1} if policy == "ssp" else {"policy": "shadow", "method": "ma"}
    run_dir, others = str(tmp_path / "job" / "run"), []

    def race(key):
        if "incarnation" in key and not others:
            others.append(None)
            others.append(make_host(config(sync), run_dir, LocalServerReports(LocalLink()), restarted=True))

    wrap_server_storage(monkeypatch, after_look=race)
    first = make_host(config(sync), run_dir, LocalServerReports(LocalLink()), restarted=True)
    incarnations = sorted([first.core.incarnation, others[1].core.incarnation])
    assert incarnations == [1, 2], f"two restarts took incarnations {incarnations}"
