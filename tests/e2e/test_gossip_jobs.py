"""Gossip (`dpsgd`, and `choco` with uint8) end to end on the shared local Ray: one short run through
churn. w1 is SIGKILLed while its exchange is in flight, its slot rejoins and starts from a live replica, then the job is
scaled down to 3: it finishes, the members that never died keep their processes and their own
replicas (only the joiner receives a state), the members behind skip ahead and count what they skip,
and no sample is applied twice."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import wait_until

PER_WORKER = 2  # 120 steps x 4 x 2 samples stay within one data epoch of digits (1437 training samples)


@pytest.mark.parametrize("policy,codec", [("dpsgd", "none"), pytest.param("choco", "uint8", marks=pytest.mark.slow)])
# choco: its literal simulation, a split exchange and copies restarting at every epoch are checked in process
# (tests/unit/test_choco.py); end to end through a kill in the slow tier
@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_gossip_through_a_kill_mid_exchange_a_rejoin_and_a_scale_down(run_root, policy, codec):
    """`choco` too: its public copies start again from zero in every membership epoch."""
    steps, delay = 120, 0.1  # ~12 s of training a member: past the replacement's start and a scale-down
    cfg = {"name": f"{policy}-churn", "seed": 4, "compression": {"codec": codec},
           "workers": {"count": 4, "min": 2, "max": 4, "cpus": 0.5, "batch_mode": "keep_worker"},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": PER_WORKER},
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.5},
           "sync": {"policy": policy, "topology": {"kind": "ring"}, "consensus_every": 5},
           "stop": {"max_steps": steps}, "eval_every": 0,
           "faults": {"record_samples": True, "stragglers": [{"slot": f"w{i}", "delay_s": delay} for i in range(4)],
                      "kills": [{"slot": "w1", "step": 12, "at": "allreduce"}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    pids = wait_until(lambda: {m.slot: m.pid for m in job.status().members if m.pid and m.state == "training"}
                      if len([m for m in job.status().members if m.state == "training"]) == 4 else None,
                      timeout=60, what="four training members")
    status = job.status()
    assert status.topology["kind"] == "ring" and status.topology["world_size"] == 4, status.topology
    assert abs(status.topology["spectral_gap"] - 2 / 3) < 1e-6, status.topology  # ring of 4: |lambda_2(W)| = 1/3
    wait_until(lambda: any(e["kind"] == "reshape" and "w1" in e["detail"].get("joiners", []) for e in job.events()),
               timeout=90, what="w1's replacement to join")
    job.scale(3)
    result = job.wait(timeout=120)
    assert result.state == "FINISHED" and result.step == steps, result
    events = job.events()
    fired = [e for e in events if e["kind"] == "fault"]
    assert [(e["detail"]["slot"], e["detail"]["phase"]) for e in fired] == [("w1", "allreduce")], fired
    final = job.status()
    for m in final.members:
        if m.slot != "w1" and m.slot in pids:
            assert m.pid == pids[m.slot], f"{m.slot} was restarted"
    sources = {}  # in the join's reshape event, or in an event of its own when the reshape went out first
    for e in events:
        if e["kind"] == "reshape":
            sources.update(e["detail"].get("state_sources", {}))
        elif e["detail"].get("state_source"):
            sources[e["detail"]["slot"]] = e["detail"]["state_source"]
    assert set(sources) == {"w1"}, f"only the joiner receives a state; the others keep their replicas: {sources}"
    assert sources["w1"]["source"] != "w1" and sources["w1"]["step"] > 12, sources
    history = job.history()
    by_slot = defaultdict(list)
    for record in history:
        by_slot[record["slot"]].append(record["step"])
    for slot, seen in by_slot.items():
        assert seen == sorted(set(seen)), f"{slot} reported a step twice"
    dropped = sum(r.get("dropped_samples", 0) for r in history)
    assert dropped > 0, "the members behind at an entry skip ahead and count the samples they skip"
    consensus = [r["consensus"] for r in history if "consensus" in r]
    assert consensus and max(consensus) < 1.0, consensus
    ids = []
    for path in (job.run_dir / "samples").glob("w*.txt"):
        ids += [int(i) for line in path.read_text().splitlines() if not line.startswith("dropped") for i in line.split()[2:]]
    assert len(ids) == len(set(ids)), "a sample was applied twice within the data epoch"
    average = [e for e in events if e["reason"].startswith("final model: the average of")]
    assert average, [e["reason"] for e in events]
    assert job.model()(torch.zeros(2, 64)).shape == (2, 10)
    if policy == "choco":
        w0 = [r for r in history if r["slot"] == "w0"]
        last_epoch = max(r["membership_epoch"] for r in w0)
        before = max((r["bytes_sent"] for r in w0 if r["membership_epoch"] < last_epoch), default=0)
        assert max(r["bytes_sent"] for r in w0) > before, "no exchange in the newest epoch"
    print(f"{policy} under churn: FINISHED at {result.step} in {result.elapsed_s:.1f}s; w1 got its state from "
          f"{sources['w1']}; {dropped} samples skipped; max consensus {max(consensus):.3g}; {average[0]['reason']}")
