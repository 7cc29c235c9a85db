"""The server policies end to end on the shared local Ray: a parameter-server actor created by the
coordinator, detached workers pulling leases and pushing gradients. One short run per policy; SSP under
churn (a SIGKILLed worker and a 3x straggler) with every sample and lease accounted for and the bound
checked from the clocks recorded at each pull; a SIGKILLed server that Ray restarts from its snapshot
while the workers train on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import child_env, loaded_torch, wait_for_end, wait_until

PER_WORKER = 8
REPO = Path(__file__).resolve().parents[2]


def make_config(name: str, sync: dict, steps: int, per_worker: int = PER_WORKER, **over) -> dict:
    cfg = {"name": name, "seed": 4, "workers": {"count": 4, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": per_worker},
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.5}, "sync": sync, "stop": {"max_steps": steps},
           "server": {"cpus": 1}, "eval_every": 0}
    cfg.update(over)
    return cfg


def pids(job: ElasticJob, slots) -> dict[str, int]:
    return {m.slot: m.pid for m in job.status().members if m.slot in slots and m.pid}


def server_events(job: ElasticJob) -> list[dict]:
    return [e for e in job.events() if e["kind"] == "server"]


def assert_every_sample_applied_once(job: ElasticJob, steps: int) -> dict:
    """History holds versions 1..steps once each; the server's sample file has every applied id once,
    as many as the lease counts and history say; applied + requeued + dropped = leased. The counts."""
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, steps + 1))
    samples = (job.run_dir / "samples" / "server.txt").read_text().splitlines()
    applied = [int(i) for line in samples if not line.startswith("dropped") for i in line.split()[2:]]
    leases = job.status().server["leases"]
    assert len(applied) == len(set(applied)) == leases["applied"] == sum(r["samples"] for r in history)
    assert leases["applied"] + leases["requeued"] + leases["dropped"] == leases["leased"], leases
    return leases


@pytest.mark.parametrize("sync", [
    pytest.param({"policy": "asp"}, id="asp"),
    # ssp and quorum finish at max_steps in their churn tests below too (the default tier runs those)
    pytest.param({"policy": "ssp", "s": 2}, id="ssp", marks=pytest.mark.slow),
    pytest.param({"policy": "quorum", "k": 3}, id="quorum", marks=pytest.mark.slow),
    pytest.param({"policy": "elastic_bsp", "r": 4}, id="elastic_bsp", marks=pytest.mark.slow)])  # and elastic_bsp's
@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_server_policy_finishes_at_max_steps_versions(run_root, sync):
    steps = 40
    started = time.monotonic()
    job = ElasticJob(config_from_dict(make_config(f"ps-{sync['policy']}", sync, steps))).start()
    coordinator = wait_until(lambda: (s := job.status()).step >= steps // 2 and s.coordinator_pid, what="half the versions")
    # no coordinator loads torch (a coordinator that served the group store had libtorch mapped within a
    # second of its start, well before this; the BSP twin of this check is in test_elastic.py)
    rss_mib = psutil.Process(coordinator).memory_info().rss / 2**20
    assert not loaded_torch(coordinator), "the coordinator of a server kind loaded torch"
    result = job.wait(timeout=120)
    elapsed = time.monotonic() - started
    assert result.state == "FINISHED" and result.step == steps, result
    history = job.history()
    assert [r["step"] for r in history] == list(range(1, steps + 1)), "each version once, in order"
    status = job.status()
    server = status.server
    assert server["version"] == steps and server["incarnation"] == 0, server
    leases = server["leases"]
    assert leases["applied"] + leases["dropped"] + leases["requeued"] == leases["leased"] and leases["outstanding"] == 0
    model = job.model()
    x = torch.zeros(2, 64)
    assert model(x).shape == (2, 10)
    staleness = Counter(s for r in history for s in r["staleness"])
    print(f"{sync}: FINISHED at {steps} versions in {elapsed:.1f}s; coordinator {rss_mib:.0f} MiB, no torch; "
          f"staleness {dict(sorted(staleness.items()))}; "
          f"refused {({k: v for k, v in server['rejected'].items() if v})}; leases {leases}")


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_ssp_under_churn_keeps_its_bound_and_applies_every_sample_once(run_root):
    """w1 is SIGKILLed at its 8th push (Ray-level death; its slot restarts as a new incarnation), w3 takes
    3x as long per step as the others; 36 versions of 32 samples stay within one data epoch (1437)."""
    s, steps = 2, 36
    stragglers = [{"slot": f"w{i}", "delay_s": 0.03} for i in range(3)] + [{"slot": "w3", "delay_s": 0.09}]
    cfg = make_config("ps-ssp-churn", {"policy": "ssp", "s": s}, steps,
                      faults={"record_samples": True, "stragglers": stragglers, "kills": [{"slot": "w1", "step": 8}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    survivors = wait_until(lambda: (p := pids(job, ("w0", "w2", "w3"))) and len(p) == 3 and p, what="the workers' pids")
    result = job.wait(timeout=180)
    assert result.state == "FINISHED" and result.step == steps, result
    assert pids(job, ("w0", "w2", "w3")) == survivors, "survivors were restarted"
    assert any(e["kind"] == "failure" and e["detail"].get("slot") == "w1" for e in job.events()), "w1 did not die"

    leases = assert_every_sample_applied_once(job, steps)
    assert leases["requeued"] > 0, "the dead worker's lease was requeued"

    ahead = []
    for line in (job.run_dir / "samples" / "pulls.txt").read_text().splitlines():
        slot, clock, version, slowest = line.split()
        ahead.append(int(clock) - int(slowest))
        assert int(clock) - int(version) <= s
    assert max(ahead) <= s, f"a pull ran {max(ahead)} clocks ahead of the slowest live member (s = {s})"
    print(f"ssp s={s} under churn: FINISHED at {steps} versions; leases {leases}; most clocks ahead at a pull "
          f"{max(ahead)} (histogram {dict(sorted(Counter(ahead).items()))}); staleness "
          f"{job.status().server['staleness']}")


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
@pytest.mark.parametrize("s", [3])
def test_ssp_survives_a_kill_of_a_member_ahead_replaced_by_a_hot_spare(run_root, s):
    """w1 is fast and w2 a straggler, so w1's last pushes wait staged for w2's when w1 is SIGKILLed (with
    s > 0 it pulls ahead before they are applied); a hot
    spare takes slot w1 at once (a new incarnation of the same slot). Before the fix its pushes were
    refused as duplicates of the dead incarnation's staged ticket and the version never moved again."""
    steps = 45
    stragglers = [{"slot": "w2", "delay_s": 0.4}]  # w1's s pushes ahead of w2 stay staged for s x 0.4 s
    cfg = make_config("ps-ssp-spare", {"policy": "ssp", "s": s}, steps, workers={"count": 3, "cpus": 0.5, "spares": 1},
                      faults={"record_samples": True, "stragglers": stragglers, "kills": [{"slot": "w1", "step": 25}]})
    job = ElasticJob(config_from_dict(cfg)).start()  # the kill comes once the spare is ready (~8 s)
    result = job.wait(timeout=90)
    refused = job.status().server["rejected"]
    print(f"ssp s={s}, a member ahead killed and replaced by a spare: {result.state} at version {result.step}; "
          f"refused {({k: v for k, v in refused.items() if v})}")
    assert result.state == "FINISHED" and result.step == steps, result
    assert any(e["kind"] == "failure" and e["detail"].get("slot") == "w1" for e in job.events()), "w1 did not die"
    assert refused["duplicate"] == 0
    assert_every_sample_applied_once(job, steps)


def test_server_sigkill_resumes_from_its_snapshot_and_the_job_finishes(run_root):
    """ASP (nobody waits, so w3's long step keeps it holding a lease from the old incarnation when the
    server dies: its push is fenced and counted). The server's process SIGKILLs itself at version 35
    (`faults.server`), once the snapshot being stored (version 30's) is stored. (The test used to kill it
    from here once `status` showed 35 versions and a snapshot; a run that reached its 90 versions between
    two polls under load left nothing to kill, and the wait timed out: 1 CI run in 5.)"""
    every, steps, kill_at = 10, 90, 35
    stragglers = [{"slot": f"w{i}", "delay_s": 0.05} for i in range(3)] + [{"slot": "w3", "delay_s": 1.0}]
    cfg = make_config("ps-server-kill", {"policy": "asp"}, steps, server={"cpus": 1, "snapshot_every": every},
                      faults={"stragglers": stragglers, "server": [{"version": kill_at}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    workers = wait_until(lambda: (p := pids(job, ("w0", "w1", "w2", "w3"))) and len(p) == 4 and p, what="the workers' pids")
    result = wait_for_end(job, 180)
    assert result.state == "FINISHED" and result.step == steps, result
    assert pids(job, ("w0", "w1", "w2", "w3")) == workers, "workers were restarted"
    [event] = server_events(job)
    lost, resumed = event["detail"]["versions_lost"], event["detail"]["resumed_version"]
    # snapshots are stored by a thread of their own while later versions apply (no push waits for the
    # store), so versions may apply between the fault's and the kill; the kill waits for the snapshot
    # being stored, so the restart resumes from version 30's snapshot or a newer one
    assert resumed >= kill_at // every * every, event
    # history holds the versions the coordinator was told of before the kill: the server reports them as
    # they apply, and under load the reports may lag even behind the snapshot (once: history at 1, the
    # snapshot at 30). Those the snapshot holds but history lacks are named, by the event and a note
    written = event["detail"]["history_step"]
    assert lost == max(0, written - resumed)
    unreported = event["detail"]["unreported"]
    assert unreported == ([written + 1, resumed] if written < resumed else None), event
    if unreported:
        assert any((e.get("detail") or {}).get("first") == written + 1 and (e.get("detail") or {}).get("last") == resumed
                   for e in job.events()), "no note names the versions history lacks"
    assert event["detail"]["server_incarnation"] == 1, event
    status = job.status()
    assert status.server["incarnation"] == 1
    assert status.server["rejected"]["fenced_server"] >= 1, status.server["rejected"]
    history = job.history()
    redone = [r["step"] for r in history if r.get("server_incarnation") == 1]
    assert redone == list(range(resumed + 1, steps + 1)), "the new incarnation carries on from its snapshot"
    # every version reported before the kill (those after the snapshot, lost, are redone above)
    assert [r["step"] for r in history if r.get("server_incarnation") == 0] == list(range(1, written + 1))
    print(f"server SIGKILL at version {resumed + lost}: {event['reason']}; refused pushes {status.server['rejected']}")


def run_through_a_kill(name: str, sync: dict, steps: int, delay_s: float, kill_step: int,
                       per_worker: int = PER_WORKER) -> tuple[ElasticJob, dict]:
    """4 workers, w3 three times as slow (a modelled `delay_s` a step), w1 SIGKILLed at its
    `kill_step`-th push: the job finishes at `steps` with every applied sample once. (job, leases)."""
    stragglers = [{"slot": f"w{i}", "delay_s": delay_s} for i in range(3)] + [{"slot": "w3", "delay_s": 3 * delay_s}]
    cfg = make_config(name, sync, steps, per_worker, faults={"record_samples": True, "stragglers": stragglers,
                                                             "kills": [{"slot": "w1", "step": kill_step}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    result = wait_for_end(job, 180)
    assert result.state == "FINISHED" and result.step == steps, result
    return job, assert_every_sample_applied_once(job, steps)


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_quorum_through_a_kill_a_rejoin_and_late_drops_applies_every_sample_once(run_root):
    """quorum k=3 of 4 with a 3x straggler (its late pushes are dropped and their samples requeued) and
    w1 SIGKILLed at its 6th push (its slot comes back as a new incarnation and rejoins): within one
    data epoch, every applied sample id appears once, and applied + requeued + dropped = leased."""
    steps = 36  # steps of 0.2 s (0.6 s for w3): the run outlasts the replacement's start (~4-5 s here)
    job, leases = run_through_a_kill("ps-quorum-churn", {"policy": "quorum", "k": 3}, steps, 0.2, 6)
    assert leases["dropped"] > 0 and leases["requeued"] > 0, leases
    rejoined = [e for e in job.events() if e["kind"] == "reshape" and "w1" in e["detail"].get("joiners", [])]
    print(f"quorum k=3 under churn: FINISHED at {steps} versions; leases {leases}; w1 rejoined: {bool(rejoined)}")
    assert rejoined, "the killed slot's new incarnation must rejoin"


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_a_push_delayed_past_its_senders_eviction_is_fenced_and_its_samples_applied_once(run_root):
    """ASP; w1's push for its 5th clock is held in flight for 6 s (`faults.delayed_pushes`). w1 waits for
    the answer, the coordinator evicts it after `workers.hang_timeout_s` (2 s) and starts w1 again as a
    new incarnation; when the old push finally arrives it names a worker incarnation that is no longer
    a member: refused and counted, its lease already requeued, every sample applied once."""
    steps = 150  # 4 workers at 0.2 s a step: ~9 s, past the push's arrival
    stragglers = [{"slot": f"w{i}", "delay_s": 0.2} for i in range(4)]
    # 6 a worker: while w1 is away each push carries a third of 24 (8), so 150 versions stay within one
    # data epoch (1437) however long its restart takes (with 8, a third of 32 is 11: 1471 samples in CI)
    cfg = make_config("ps-delayed-push", {"policy": "asp"}, steps, per_worker=6,
                      workers={"count": 4, "cpus": 0.5, "hang_timeout_s": 2.0},
                      faults={"record_samples": True, "stragglers": stragglers,
                              "delayed_pushes": [{"slot": "w1", "clock": 4, "delay_s": 6.0}]})
    job = ElasticJob(config_from_dict(cfg)).start()
    result = job.wait(timeout=180)
    assert result.state == "FINISHED" and result.step == steps, result
    evictions = [e for e in job.events() if e.get("detail", {}).get("detector") == "step progress"
                 and e["detail"].get("slot") == "w1"]
    assert evictions and "pushing" in evictions[0]["reason"], [e["reason"] for e in job.events()]
    rejected = job.status().server["rejected"]
    assert rejected["fenced_worker"] + rejected["not_member"] == 1, rejected
    leases = assert_every_sample_applied_once(job, steps)
    assert leases["requeued"] >= 1, leases
    print(f"a push delayed past its sender's eviction: {evictions[0]['reason']}; refused {rejected}; leases {leases}")


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_resume_continues_from_the_servers_newest_snapshot_without_reapplying_a_sample(run_root):
    """ssp: a run of 20 versions (snapshots every 10), then `--resume` to 40: the new run's server loads
    the snapshot at version 20 and carries on with its data cursor; over both runs (1280 samples, within
    one data epoch of 1437) every applied sample id appears once."""
    from actors.runs.checkpoints import newest_valid_of_job
    from orchestrator.job import job_root

    base = make_config("ps-resume", {"policy": "ssp", "s": 1}, 20, server={"cpus": 1, "snapshot_every": 10},
                       faults={"record_samples": True})
    first = ElasticJob(config_from_dict(base)).start()
    assert first.wait(timeout=120).state == "FINISHED"
    config = config_from_dict(dict(base, stop={"max_steps": 40}))
    ref = newest_valid_of_job(job_root(config), server=True)
    assert ref is not None and ref.step == 20 and ref.run_id == first.run_id, ref
    second = ElasticJob(config, resume_from=str(ref.path)).start()
    result = second.wait(timeout=120)
    assert result.state == "FINISHED" and result.step == 40, result
    assert [r["step"] for r in second.history()] == list(range(21, 41))
    applied = [int(i) for job in (first, second) for line in (job.run_dir / "samples" / "server.txt").read_text().splitlines()
               if not line.startswith("dropped") for i in line.split()[2:]]
    assert len(applied) == len(set(applied)) == 40 * 4 * PER_WORKER, "a sample was applied twice across the resume"
    leases = second.status().server["leases"]
    assert leases["applied"] == 40 * 4 * PER_WORKER and leases["applied"] + leases["requeued"] + leases["dropped"] == leases["leased"]
    print(f"resumed from {ref.path.name} (version {ref.step}) to 40; leases over both runs {leases}")


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_elastic_bsp_through_a_kill_a_rejoin_and_a_straggler_applies_every_sample_once(run_root):
    """elastic_bsp r=4 with a 3x straggler; w1 SIGKILLed at its 5th push (a barrier that waited for it is
    released by the departure; its new incarnation joins at the next round): within one data epoch
    (100 versions, mostly lone pushes of 6 samples) every applied sample id appears once, and the
    barriers are numbered without a gap. Steps of 0.12 s (0.36 s for w3) leave time for the rejoin."""
    steps = 100
    # 6 a worker: with 8, a slow restart under load (3 members sharing each round's 32) applied 1443
    # samples in 100 versions, past one data epoch (1437), and the second epoch's ids repeat
    job, leases = run_through_a_kill("ps-ebsp-churn", {"policy": "elastic_bsp", "r": 4}, steps, 0.12, 4, per_worker=6)
    barriers = [r["barrier"] for r in job.history() if r.get("barrier") is not None]
    assert barriers == list(range(len(barriers))) and len(barriers) >= 3, barriers
    rejoined = [e for e in job.events() if e["kind"] == "reshape" and "w1" in e["detail"].get("joiners", [])]
    server = job.status().server
    print(f"elastic_bsp r=4 under churn: FINISHED at {steps} versions, {len(barriers)} barriers; schedules "
          f"{server['schedules']}; leases {leases}; w1 rejoined: {bool(rejoined)}")
    assert rejoined and server["schedules"]["zipline"] >= 1, server


ALL_FOUR = {"count": 4, "min": 4, "cpus": 0.5}
"""The workers of a job whose premise is that all four train when the coordinator dies: it begins once all
four are ready (with the default minimum, a loaded machine began one with 1 of 4, the other three still
starting; the restarted coordinator started those again, and they were not back before the end)."""


def sigkill_the_coordinator_midway(job: ElasticJob, steps: int, at: int):
    """SIGKILL the coordinator once history reaches version `at`; the job must still finish at
    `steps`, with the same worker processes and history 1..steps without a gap. (before, after)."""
    wait_until(lambda: job.status().step >= at, timeout=120, what=f"{at} versions")
    before = job.status()
    workers = pids(job, ("w0", "w1", "w2", "w3"))
    os.kill(before.coordinator_pid, signal.SIGKILL)
    result = job.wait(timeout=180)
    # the whole cause (pytest cuts a long repr: CI AE's "coordinator error: ..." lost its message)
    assert result.state == "FINISHED" and result.step == steps, f"{result.state} at {result.step}: {result.cause}"
    after = job.status()
    assert after.incarnation == 1 and after.coordinator_pid != before.coordinator_pid
    assert pids(job, ("w0", "w1", "w2", "w3")) == workers, "workers were restarted"
    assert [r["step"] for r in job.history()] == list(range(1, steps + 1)), "history has a gap or a repeat"
    return before, after


def test_elastic_bsp_keeps_its_barriers_while_the_coordinator_is_down(run_root):
    """SIGKILL of the coordinator mid-run (r = 4): the server places its barriers without it (a barrier
    after r iterations), the workers never block, and the restarted coordinator plans again."""
    steps = 150
    stragglers = [{"slot": f"w{i}", "delay_s": 0.03} for i in range(3)] + [{"slot": "w3", "delay_s": 0.09}]
    job = ElasticJob(config_from_dict(make_config("ps-ebsp-coordinator-kill", {"policy": "elastic_bsp", "r": 4}, steps,
                                                  faults={"stragglers": stragglers}, workers=ALL_FOUR))).start()
    before, after = sigkill_the_coordinator_midway(job, steps, 20)
    schedules = after.server["schedules"]
    print(f"coordinator SIGKILLed at version {before.step} of {steps}: barriers {after.server['barriers']}, schedules {schedules}")
    assert schedules["fallback"] >= 2 and schedules["zipline"] >= 1, schedules


@pytest.mark.slow  # 14.5 s; beyond the default suite's budget (the server's own loss is tested there)
def test_coordinator_sigkill_reattaches_to_the_server_and_workers(run_root):
    """Ray restarts the coordinator; the detached server and workers train on meanwhile; the new
    incarnation finds the server by name and fills history from the records it kept."""
    steps = 120
    stragglers = [{"slot": f"w{i}", "delay_s": 0.04} for i in range(4)]
    job = ElasticJob(config_from_dict(make_config("ps-coordinator-kill", {"policy": "ssp", "s": 2}, steps,
                                                  faults={"stragglers": stragglers}, workers=ALL_FOUR))).start()
    before, after = sigkill_the_coordinator_midway(job, steps, 25)
    assert after.server["pid"] == before.server["pid"], "the server was restarted"
    print(f"coordinator SIGKILLed at version {before.step}: the server (pid {before.server['pid']}) and workers kept "
          f"training; history 1..{steps}, no gap")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["asp", "ssp", "quorum", "elastic_bsp"])
def test_ready_config_runs_from_a_fresh_shell(tmp_path, policy):
    """`python -m orchestrator run` with no Ray running: it sizes a local Ray for the workers and the
    server, places the server, and finishes (100 versions, a 3x straggler)."""
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(tmp_path))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", f"configs/digits_{policy}.yaml", "--set", "stop.max_steps=100",
                           "--set", "stop.target=null", "--set", "faults.stragglers=[{slot: w3, slowdown: 3.0}]"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-600:], proc.stderr[-600:])
    assert proc.returncode == 0 and f"FINISHED: digits-{policy}" in proc.stdout and "at step 100" in proc.stdout
