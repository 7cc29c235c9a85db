"""`plan` and `sync.policy: auto` (orchestrator/planner.py): the candidates a job gets, the network the
model sees, the ranking rule, the choice written into the config, and the CLI's table. The predictions
themselves are the runtime model's (tests/unit/test_runtime_model.py)."""
from __future__ import annotations

import json
import math

import pytest

from algorithms.rules.runtime_model import INF, Compute, predict
from core.schema import ConfigError
from orchestrator import planner
from orchestrator.config import config_from_dict

BASE = {"name": "plan", "workers": {"count": 4}, "stop": {"max_steps": 200},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 64}, "batch_size": 16}}
LAB = {"nodes": 2, "workers_per_node": 2, "inter": {"mbit": 100, "latency_ms": 1.0}}


def cfg(**over):
    return config_from_dict({**BASE, **over})


def labels(c) -> list[str]:
    return [x.label for x in planner.candidates(c)]


def test_candidates_follow_the_optimizer_and_the_network():
    sgd = labels(cfg())
    assert "bsp" in sgd and "choco ring uint8" in sgd and "dpsgd ring" in sgd
    assert not any(x.startswith(("qadam", "dadam", "bsp hierarchical")) for x in sgd)
    assert not any(x.split()[0] in ("asp", "ssp", "quorum", "elastic_bsp") for x in sgd)  # not on the lab's links
    adam = labels(cfg(optimizer={"name": "adamw", "lr": 0.003}, network=LAB))
    assert "qadam uint8" in adam and "dadam ring k=4" in adam and "bsp hierarchical" in adam
    for c in planner.candidates(cfg(optimizer={"name": "adamw", "lr": 0.003}, network=LAB)):
        config_from_dict({**BASE, "optimizer": {"name": "adamw", "lr": 0.003}, "network": LAB, "sync": c.sync,
                          "compression": c.compression})  # every candidate is a valid job


def test_the_network_places_slots_as_the_job_does_and_takes_probed_links():
    c = cfg(network=LAB)
    net = planner.network_for(c.network, 4)
    assert net.node_of_rank == (0, 0, 1, 1)
    assert net.bandwidth[0][1] == pytest.approx(100e6 / 8) and net.bandwidth[0][0] == INF
    assert net.latency[1][0] == pytest.approx(1e-3)
    probed = planner.network_for(c.network, 4, [{"a": 0, "b": 1, "asked_mbit": 100, "measured_mbit": 90.0,
                                                  "rtt_ms": 0.2, "modelled_latency_ms": 1.0}])
    assert probed.bandwidth[0][1] == pytest.approx(90e6 / 8) and probed.bandwidth[1][0] == pytest.approx(100e6 / 8)
    assert probed.latency[0][1] == pytest.approx(1.1e-3)
    assert probed.host_bytes_per_s == INF  # no unshaped stream was probed
    intra = planner.network_for(c.network, 4, [{"a": 0, "b": 0, "asked_mbit": None, "measured_mbit": 20000.0,
                                                 "rtt_ms": 0.04, "modelled_latency_ms": 0.0}])
    assert intra.host_bytes_per_s == intra.loopback_bytes_per_s == pytest.approx(20e9 / 8)
    assert planner.network_for(cfg().network, 3).node_of_rank == (0, 0, 0)


def test_the_labs_host_times_are_measured_per_pattern_and_only_in_the_lab(monkeypatch):
    """Each pattern the candidates run is timed among the job's ranks, each in a process of its own
    (`measure_host`); `ranked` measures them in the lab only (its nodes share this machine)."""
    c = cfg(network=LAB)
    size = 16384.0
    picked = [x for x in planner.candidates(c) if x.label in ("bsp", "bytegrad uint8", "choco ring uint8")]
    measured = planner.measure_host(c, picked, size, rounds=3, warmup=2)
    assert set(measured) == {"bsp/none", "bsp/none:cpu", "bytegrad/uint8", "bytegrad/uint8:cpu",
                             "choco/uint8", "choco/uint8:cpu"}
    assert all(0 <= v < 1.0 for v in measured.values()) and measured["bsp/none"] > 0
    net = planner.network_for(c.network, 4, None, {"bsp/none": 0.006})
    assert net.host("bsp/none") == 0.006 and net.host("bytegrad/uint8") == 0.0
    calls = []
    monkeypatch.setattr(planner, "measure_host", lambda job, cands, nbytes, **_: calls.append(job.workers.count) or {"bsp/none": 0.006})
    bsp = [x for x in planner.candidates(c) if x.label == "bsp"]
    with_host = planner.ranked(c, bsp, 0.01, 1.2e6)[0].step_s
    assert calls == [4]
    assert with_host == pytest.approx(predict(bsp[0].spec, planner.network_for(c.network, 4, None, {"bsp/none": 0.006}),
                                              Compute(0.01), 1.2e6).step_s)
    planner.ranked(cfg(), [x for x in planner.candidates(cfg()) if x.label == "bsp"], 0.01, 1.2e6)
    assert calls == [4], "no lab: nothing measured"


def test_stragglers_and_jitter_reach_the_compute_side():
    c = cfg(faults={"stragglers": [{"slot": "w1", "slowdown": 3.0}, {"slot": "w2", "jitter": {"sigma": 0.4}}]})
    compute = planner.compute_spread(c, 0.01)
    assert compute.factors == (1.0, 3.0, 1.0, 1.0) and compute.jitter_sigma == 0.4


def test_rank_orders_by_time_to_target_when_every_candidate_has_a_factor():
    c = cfg(network=LAB)
    cands = [x for x in planner.candidates(c) if x.label in ("bsp", "local_sgd h=8", "dpsgd ring")]
    net, compute, size = planner.network_for(c.network, 4), Compute(0.01), 1.2e6
    step = {x.label: predict(x.spec, net, compute, size).step_s for x in cands}
    factors = {"bsp": 1.0, "local_sgd h=8": 1.5, "dpsgd ring": 10.0}
    rows = planner.rank(cands, net, compute, size, factors, bsp_steps=200)
    assert [r.candidate.label for r in rows] == sorted(step, key=lambda k: step[k] * factors[k])
    assert rows[0].to_target_s == pytest.approx(step[rows[0].candidate.label] * 200 * factors[rows[0].candidate.label])
    partial = planner.rank(cands, net, compute, size, {"bsp": 1.0}, bsp_steps=200)  # factors missing: no time to target
    assert [r.to_target_s is None for r in partial] == [False, True, True] and partial[0].candidate.label == "bsp"
    assert all(r.note.startswith("convergence unknown") for r in partial[1:])


def test_a_relaxed_policy_needs_a_clear_lead_and_is_not_credited_with_fewer_steps_than_bsp_by_default():
    """At 100 Mbit/s local SGD's step is far shorter than BSP's: with factor 1.05 it is recommended.
    Its factor below 1 counts as 1 unless the factors were measured around the job's rate and world size
    (`credit`, the test below); a relaxed lead under 10% of BSP's time to the target leaves BSP
    recommended."""
    c = cfg(network=LAB)
    cands = [x for x in planner.candidates(c) if x.label in ("bsp", "local_sgd h=8")]
    net, size = planner.network_for(c.network, 4), 1.2e6
    slow_net = planner.rank(cands, net, Compute(0.01), size, {"local_sgd h=8": 1.05}, bsp_steps=100)
    assert slow_net[0].candidate.label == "local_sgd h=8"
    credited = planner.rank(cands, net, Compute(0.01), size, {"local_sgd h=8": 0.5}, bsp_steps=100)
    assert next(r for r in credited if r.candidate.label == "local_sgd h=8").factor == 1.0
    one_node = planner.network_for(cfg().network, 4)  # no network cost: BSP's step is hardly longer
    step = {x.label: predict(x.spec, one_node, Compute(0.01), size).step_s for x in cands}
    assert step["local_sgd h=8"] < step["bsp"] < step["local_sgd h=8"] / (1 - planner.RELAXED_MARGIN)
    assert planner.rank(cands, one_node, Compute(0.01), size, {"local_sgd h=8": 1.0}, bsp_steps=100)[0].exact


def test_factors_apply_only_to_their_workload_family_optimizer_and_target_metric():
    data = planner.load_factors()
    target = {"metric": "accuracy", "value": 0.95}
    assert planner.factors_apply(cfg(stop={"max_steps": 200, "target": target}), data) == (True, "")
    for over, word in (({"optimizer": {"name": "adamw", "lr": 0.003}}, "optimizer adamw"),
                       ({"workload": {"factory": "orchestrator.workloads.lm:gpt"}}, "workload orchestrator.workloads.lm"),
                       ({}, "target metric none")):
        job = config_from_dict({**BASE, "stop": {"max_steps": 200, **({} if word.startswith("target") else {"target": target})},
                                **over})
        applies, why = planner.factors_apply(job, data)
        assert not applies and word in why, why


def test_on_one_unshaped_node_an_exact_policy_is_recommended_with_the_shipped_factors():
    """(It recommended `dpsgd ring uint8`, "0.0 s to the target against BSP's 0.1 s", for
    configs/digits_bsp.yaml on one machine.)"""
    job = cfg(stop={"max_steps": 600, "target": {"metric": "accuracy", "value": 0.96}})
    rows = planner.ranked(job, planner.candidates(job), 0.004, 1.2e6)
    assert rows[0].exact and rows[0].candidate.label == "bsp", planner.table(rows, planner.factors_line(job))
    adam = cfg(optimizer={"name": "adamw", "lr": 0.003}, stop={"max_steps": 600})
    rows = planner.ranked(adam, planner.candidates(adam), 0.004, 1.2e6)
    assert rows[0].exact and all(r.to_target_s is None for r in rows)
    assert all(r.note == "one node: no network to save" for r in rows if not r.exact)
    # across nodes, without factors for AdamW: the exact policies by step time, the others' convergence unknown
    two = cfg(optimizer={"name": "adamw", "lr": 0.003}, network=LAB)
    rows = planner.rank(planner.candidates(two), planner.network_for(two.network, 4), Compute(0.004), 1.2e6, None,
                        None, "optimizer adamw")
    assert [r.exact for r in rows[:2]] == [True, True] and not any(r.exact for r in rows[2:])
    assert all(r.note == "convergence unknown for this workload: optimizer adamw" for r in rows[2:])


def test_ties_keep_the_candidates_order_never_their_names():
    net, compute = planner.network_for(cfg().network, 4), Compute(0.01)
    twins = [planner.Candidate(label, {"policy": "dpsgd"}, {}, planner.PolicySpec("dpsgd")) for label in ("zz", "aa")]
    assert [r.candidate.label for r in planner.rank(twins, net, compute, 1e6, None)] == ["zz", "aa"]
    assert [r.candidate.label for r in planner.rank(twins, net, compute, 1e6, {"zz": 1.0, "aa": 1.0}, 10)] == ["zz", "aa"]


def test_auto_writes_the_pick_into_the_config_with_its_reason(monkeypatch):
    monkeypatch.setattr(planner, "load_factors", lambda **_: {"factors": {}, "bsp_steps": None, "source": ""})
    # the host times as measured (the test above measures them; 4 processes and 13 s here)
    monkeypatch.setattr(planner, "measure_host", lambda job, cands, nbytes, **_: {"bsp/none": 0.006, "bytegrad/uint8": 0.004})
    c = cfg(network=LAB, sync={"policy": "auto", "candidates": ["bsp", "bytegrad"]})
    chosen, line, rows = planner.choose(c, compute_s=0.01, model_bytes=1.2e6)
    assert "(no convergence factors apply (no convergence factors were measured)" in line
    assert {r.candidate.label for r in rows} == {"bsp", "bsp hierarchical", "bytegrad uint8", "bytegrad hierarchical uint8"}
    assert chosen.sync.policy == rows[0].candidate.sync["policy"] and chosen.policy_choice.endswith(line)
    assert chosen.compression.codec == rows[0].candidate.compression.get("codec", "none")
    with pytest.raises(ConfigError, match="sync.candidates"):
        planner.choose(cfg(sync={"policy": "auto", "candidates": ["asp"]}), compute_s=0.01, model_bytes=1e6)


def test_auto_is_a_policy_the_schema_knows():
    assert cfg(sync={"policy": "auto"}).sync.policy == "auto"
    with pytest.raises(ConfigError, match="or auto"):
        cfg(sync={"policy": "fastest"})


def test_plan_prints_the_table_and_one_recommendation(tmp_path, capsys, monkeypatch):
    from orchestrator import lab
    from orchestrator.cli import main

    monkeypatch.setattr(lab, "current", lambda: None)  # whatever this machine's lo holds: no lab is up
    measured, measure = [], planner.measure_host  # the host times once (7 s here), for both tables

    def measure_once(*args, **kw):
        measured[:] = measured or [measure(*args, **kw)]
        return measured[0]
    monkeypatch.setattr(planner, "measure_host", measure_once)

    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({**BASE, "network": LAB}))
    assert main(["plan", str(path), "--compute-ms", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compute_s"] == pytest.approx(0.005) and out["model_bytes"] > 0
    assert out["recommendation"].startswith(out["rows"][0]["policy"])
    assert main(["plan", str(path), "--probe"]) == 2  # probing needs the lab up (and root)
    assert "the lab is not up" in capsys.readouterr().err
    assert main(["plan", str(path), "--compute-ms", "5"]) == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "bsp hierarchical" in text
    assert len(measured) == 1, "the plan command measured this machine's host times"


def test_auto_on_resume_keeps_the_policy_the_checkpoints_run_picked(tmp_path):
    import yaml

    ran = cfg(sync={"policy": "dpsgd"}, compression={"codec": "uint8"}).to_dict()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(ran))
    kept, line = planner.resumed_choice(cfg(sync={"policy": "auto"}), tmp_path / "checkpoints" / "step-10.pt")
    assert kept.sync.policy == "dpsgd" and kept.compression.codec == "uint8" and line.startswith("dpsgd")
    with pytest.raises(ConfigError, match="--resume"):
        planner.resumed_choice(cfg(sync={"policy": "auto"}), tmp_path / "elsewhere" / "checkpoints" / "step-1.pt")


def test_auto_on_resume_refuses_a_picked_shadow_as_the_cli_refuses_shadow(tmp_path):
    """(The CLI's check saw "auto" and let the resume of a shadow pick through.)"""
    import yaml

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg(sync={"policy": "shadow"}).to_dict()))
    with pytest.raises(ConfigError, match="--resume: policy 'shadow' does not resume"):
        planner.resumed_choice(cfg(sync={"policy": "auto"}), tmp_path / "checkpoints" / "step-10.pt")


def test_autos_line_names_the_factors_source():
    job = cfg(stop={"max_steps": 600, "target": {"metric": "accuracy", "value": 0.96}}, sync={"policy": "auto"})
    _, line, _ = planner.choose(job, compute_s=0.004, model_bytes=1.2e6)
    assert "(convergence factors: benchmarks/results/tradeoffs.jsonl" in line


def _probed(step_s: float, ranks: int = 4) -> dict:
    """What actors/training/probe.py returns for `ranks` probes on one node, each step `step_s` (12 steps)."""
    return {"nodes": ["10.0.0.1"], "node_of_rank": [0] * ranks, "compute": [[step_s] * 12 for _ in range(ranks)],
            "backward": [[step_s / 2] * 12 for _ in range(ranks)], "model_bytes": 35880.0, "device": "cpu",
            "threads": 1, "links": [{"a": 0, "b": 0, "bytes_per_s": 1e9, "latency_s": 1e-5, "points": []}]}


def test_a_told_compute_time_replaces_the_probes_in_the_ranking():
    """`plan --probe --compute-ms X` on a cluster: the rows are ranked with X (the probe's per-rank spread
    kept around it), not with the probe's own median; printing X and ranking with the probe's was a bug."""
    c = cfg()
    cands = [x for x in planner.candidates(c, 1) if x.label == "bsp"]
    measured = planner.ranked(c, cands, 0.001, 35880.0, cluster=_probed(0.001))
    told = planner.ranked(c, cands, 0.050, 35880.0, cluster=_probed(0.001))
    assert measured[0].step_s < 0.01 and told[0].step_s >= 0.050, (measured[0].step_s, told[0].step_s)


def test_auto_on_resume_of_a_trials_run_keeps_its_candidates_so_the_state_picks_its_policy(tmp_path):
    """A trial switched policy mid-run: the checkpoint's state holds the policy it was saved under (any of
    the candidates), so the resumed config keeps the trial's candidates (the workers switch to the state's
    policy as they load it) and runs no new trial."""
    import yaml

    trial = {"steps": 10, "candidates": [
        {"label": "bsp", "sync": {"policy": "bsp"}, "compression": {"codec": "none"}, "step_s": 0.01, "factor": 1.0},
        {"label": "diloco h=16", "sync": {"policy": "diloco", "h": 16}, "compression": {"codec": "none"},
         "step_s": 0.005, "factor": 1.3}]}
    ran = cfg(sync={"policy": "bsp"}).to_dict()
    ran["policy_trial"] = trial
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(ran))
    kept, line = planner.resumed_choice(cfg(sync={"policy": "auto", "auto": {"trial_steps": 10}}),
                                        tmp_path / "checkpoints" / "step-10.pt")
    assert kept.policy_trial["candidates"] == trial["candidates"] and kept.policy_trial.get("resumed")
    assert "the policy its state was saved under" in line


def test_a_told_network_of_a_real_cluster_is_ranked_as_told_with_compute_measured_on_the_cluster():
    """`network: {emulate: false, ...}` describes the real cluster's links: no lab (nothing to bring up),
    the workers run where Ray places them, and `auto`/`plan` rank on the told links with the compute the
    probes measured (their links, measured on one node here, are not used), and say so."""
    from orchestrator import lab

    told = {"nodes": 2, "workers_per_node": 2, "emulate": False, "inter": {"mbit": 100, "latency_ms": 1.0}}
    job = cfg(network=told, sync={"policy": "auto"})
    assert job.network.enabled and not job.network.lab
    with pytest.raises(lab.LabUnavailable, match="emulate is false"):
        lab.up(job.network)
    cfg(network=told, sync={"policy": "asp"}, workers={"count": 4, "gpus": 1})  # the lab's limits are not a real cluster's
    chosen, line, rows = planner.choose(job, cluster=_probed(0.005))
    bsp = next(r for r in rows if r.candidate.label == "bsp")
    assert "bsp hierarchical" in [r.candidate.label for r in rows]  # two told nodes, though the probes shared one
    assert bsp.step_s > 0.005 + 0.9 * 2 * 3 / 4 * 35880 / 12.5e6  # the told 100 Mbit/s ring, not the probe's 1 GB/s
    assert "the network as told" in line and "measured on the cluster" in line


def test_a_told_real_cluster_shares_each_nodes_nic_where_the_lab_does_not():
    told = planner.network_for(cfg(network={"nodes": 3, "emulate": False}).network, 3)
    emulated = planner.network_for(cfg(network={"nodes": 3}).network, 3)
    assert told.nic_bytes_per_s == (1000e6 / 8,) * 3 and emulated.nic_bytes_per_s == ()


def test_a_bucketed_policys_buckets_are_the_jobs_own_from_the_models_parameters():
    """The lab's digits MLP (hidden 512, depth 2): parameters of 32768, 512, 262144, 512, 5120 and 10 floats.
    In 0.25 MiB (262144-byte) buckets, filled from the last parameter back (the Python hooks' order, which the
    lab runs: its latency is modelled): 10 + 5120 + 512 floats (22568 bytes) fill the first, the 1 MiB weight
    is a bucket alone, then 512 + 32768 floats (133120 bytes). Policies that do not bucket keep none."""
    from orchestrator.planning.candidates import with_layout

    layout = [(32768, "float32"), (512, "float32"), (262144, "float32"), (512, "float32"), (5120, "float32"),
              (10, "float32")]
    c = cfg(network=LAB, sync={"policy": "bsp", "bucket_mb": 0.25})
    cands = {x.label: x for x in with_layout(planner.candidates(c), layout, lab=True)}
    for label in ("bsp", "bsp hierarchical", "bytegrad uint8"):
        assert cands[label].spec.bucket_sizes == (22568.0, 1048576.0, 133120.0), label
    assert cands["local_sgd h=8"].spec.bucket_sizes == ()
    one = {x.label: x for x in with_layout(planner.candidates(cfg(network=LAB)), layout, lab=True)}
    assert one["bsp"].spec.bucket_sizes == (1204264.0,)  # 25 MiB: the whole model in one bucket


def test_the_trial_takes_at_most_its_share_of_the_jobs_predicted_steps():
    """A trial costs, per candidate, its first commit (h steps for a periodic kind, h / fragments plus the
    overlap for streaming DiLoCo, whose fragments commit in turn, 1 otherwise), its turn (`trial_steps`
    rounded up to whole rounds of h) and the wait for the commit at which the next switch is adopted (up to
    the same gap): 2 gap + ceil(10/h) h. With `max_share` 0.25 the trial fits in a quarter of the job's
    predicted steps (`stop.max_steps`, or BSP's steps to the target times the first candidate's factor),
    candidates dropped from the end of the shortlist until it does; with fewer than two left no trial runs
    and the line says why. A long job tries all it asked for."""
    told = {"emulate": False, "nodes": 2, "workers_per_node": 2, "inter": {"mbit": 100, "latency_ms": 1.0}}

    def job(max_steps: int, target: bool = False, share: float = 0.25, lr: float = 0.1) -> object:
        stop = {"max_steps": max_steps, **({"target": {"metric": "accuracy", "value": 0.96}} if target else {})}
        # the factors' BSP steps were counted at lr 0.1 and 4 x 32 samples a step (orchestrator/convergence.json)
        return cfg(network=told, stop=stop, eval_every=5, optimizer={"name": "sgd", "lr": lr, "momentum": 0.9},
                   workload={**BASE["workload"], "batch_size": 32},
                   sync={"policy": "auto", "auto": {"trial_steps": 10, "candidates": 3, "max_share": share}})

    def cost(c) -> int:
        h = c.sync.get("h", 1)
        gap = h // c.sync.get("fragments", 1) + c.sync.get("overlap", 0)
        return 2 * gap + -(-10 // h) * h

    # no target: no factors apply, the exact policies alone (flat and hierarchical BSP, 12 steps each)
    chosen, line, _ = planner.choose(job(100_000), compute_s=0.02, model_bytes=1.2e6)
    assert [c["label"] for c in chosen.policy_trial["candidates"]] == ["bsp hierarchical", "bsp"]
    assert line.startswith("trying bsp hierarchical, bsp for 10 steps each")
    chosen, line, _ = planner.choose(job(95), compute_s=0.02, model_bytes=1.2e6)  # 24 steps > 95 / 4
    assert not chosen.policy_trial
    assert line.startswith("no trial: the job's predicted 95 steps are too few (a trial of 2 candidates takes about 24")
    assert planner.choose(job(96), compute_s=0.02, model_bytes=1.2e6)[0].policy_trial  # 24 = 96 / 4
    # a target the factors apply to: the job's length is BSP's steps to it times the first candidate's factor
    factors = planner.load_factors()
    for share in (0.25, 1.0):
        chosen, line, rows = planner.choose(job(100_000, target=True, share=share), compute_s=0.02, model_bytes=1.2e6)
        asked = planner.shortlist(rows, 3)
        predicted = factors["bsp_steps"] * (asked[0].factor or 1.0)
        fits = [k for k in (3, 2) if sum(cost(r.candidate) for r in asked[:k]) <= share * predicted]
        tried = [c["label"] for c in chosen.policy_trial.get("candidates", [])]
        assert tried == ([r.candidate.label for r in asked[:fits[0]]] if fits else []), (share, predicted, line)
    assert len(tried) >= 2, "as long as the job: a trial fits"


def test_the_factors_bsp_steps_predict_a_jobs_length_only_at_the_rate_batch_and_target_they_were_counted_at():
    """BSP's steps to the target in orchestrator/convergence.json were counted at one learning rate, global
    batch and target value. A job at another says nothing about its length by them (at a fifth of the rate
    the digits MLP takes about twice the steps to 0.96), so its length is `stop.max_steps` alone, unless
    the file has a set counted at its rate. (Before,
    any job with the factors' workload, optimizer and metric was predicted at their BSP steps, and a trial
    asked of a job at lr 0.02 was cut to fit a quarter of 80 steps.)"""
    data = planner.load_factors()
    at = data["measured_at"]
    told = {"emulate": False, "nodes": 2, "workers_per_node": 2, "inter": {"mbit": 100, "latency_ms": 1.0}}

    def job(lr: float, batch: int, value: float) -> object:
        return cfg(network=told, eval_every=5, optimizer={"name": "sgd", "lr": lr, "momentum": 0.9},
                   workload={**BASE["workload"], "batch_size": batch},
                   stop={"max_steps": 600, "target": {"metric": "accuracy", "value": value}},
                   sync={"policy": "auto", "auto": {"trial_steps": 10, "candidates": 3}})

    same = job(at["lr"], at["global_batch"] // 4, at["target"])
    assert planner.bsp_steps_apply(same, data) == (True, "")
    rows = planner.ranked(same, planner.candidates(same), 0.02, 1.2e6)
    asked = planner.shortlist(rows, 3)
    assert planner.job_steps(same, asked) == min(600, data["bsp_steps"] * (asked[0].factor or 1.0))
    for lr, batch, value, word in ((0.05, 32, 0.96, "lr 0.05"), (0.1, 16, 0.96, "global_batch 64"),
                                   (0.1, 32, 0.97, "target 0.97")):
        other = job(lr, batch, value)
        applies, why = planner.bsp_steps_apply(other, data)
        assert not applies and word in why, why
        assert planner.factors_apply(other, data) == (True, "")  # the ratios still rank the policies
        assert planner.job_steps(other, asked) == 600.0  # lr 0.05: between the rates measured, counted at neither
    chosen, line, _ = planner.choose(job(0.05, 32, 0.96), compute_s=0.02, model_bytes=1.2e6)
    assert len(chosen.policy_trial["candidates"]) == 3, line  # about 92 steps of 600: all three asked
    slow = planner.load_factors(lr=0.02)  # a rate with a set of its own: its BSP steps set the job's length
    assert slow["measured_at"]["lr"] == 0.02 and planner.bsp_steps_apply(job(0.02, 32, 0.96), slow) == (True, "")
    assert planner.job_steps(job(0.02, 32, 0.96), asked) == min(600, slow["bsp_steps"] * (asked[0].factor or 1.0))
    assert planner.bsp_steps_apply(cfg(), {**data, "measured_at": {}})[0] is False


def test_the_factors_are_the_set_measured_at_the_jobs_rate_or_interpolated_in_log_rate_between_two(tmp_path):
    """A periodic policy's steps relative to BSP's move with the learning rate (on the digits MLP, local SGD
    h=8 took 0.90 of BSP's steps at lr 0.1 and more than BSP's at lr 0.02), so the file holds one set per
    rate measured. A job at a measured rate gets that set; between two, factor f(lr) = f_lo + w (f_hi - f_lo)
    with w = ln(lr / lr_lo) / ln(lr_hi / lr_lo), and BSP's steps exp((1 - w) ln s_lo + w ln s_hi), which say
    nothing of the job's length (counted at neither rate); outside them, the nearest set. (Before, every job
    got the factors measured at lr 0.1.)"""
    scope = {"workload": "orchestrator.workloads.digits", "optimizer": "sgd", "metric": "accuracy"}
    fast = {"factors": {"bsp": 1.0, "local_sgd h=8": 0.9}, "bsp_steps": 80, "source": "at 0.1",
            "measured_at": {"target": 0.96, "lr": 0.1, "global_batch": 128}}
    slow = {"factors": {"bsp": 1.0, "local_sgd h=8": 1.3, "diloco h=16": 0.8}, "bsp_steps": 160, "source": "at 0.02",
            "measured_at": {"target": 0.96, "lr": 0.02, "global_batch": 128}}
    path = tmp_path / "convergence.json"
    path.write_text(json.dumps({"applies_to": scope, "sets": [fast, slow]}))
    assert planner.load_factors(path)["factors"]["local_sgd h=8"] == 0.9  # no rate: the first set
    assert planner.load_factors(path, lr=0.1)["bsp_steps"] == 80
    at02 = planner.load_factors(path, lr=0.02)
    assert at02["factors"]["local_sgd h=8"] == 1.3 and at02["bsp_steps"] == 160 and at02["applies_to"] == scope
    mid = 0.02 * 5 ** 0.25  # a quarter of the way from 0.02 to 0.1 in log(rate)
    between = planner.load_factors(path, lr=mid)
    assert abs(between["factors"]["local_sgd h=8"] - (1.3 + 0.25 * (0.9 - 1.3))) < 1e-12
    assert "diloco h=16" not in between["factors"]  # measured at one rate only: no factor between
    assert between["bsp_steps"] == round(160 ** 0.75 * 80 ** 0.25)
    assert "interpolated in log(rate) at lr" in between["source"]
    for lr, near in ((0.5, 80), (0.005, 160)):
        outside = planner.load_factors(path, lr=lr)
        assert outside["bsp_steps"] == near and "outside the rates measured (0.02, 0.1)" in outside["source"]

    def job(lr: float) -> object:
        return cfg(optimizer={"name": "sgd", "lr": lr, "momentum": 0.9}, workload={**BASE["workload"], "batch_size": 32},
                   stop={"max_steps": 600, "target": {"metric": "accuracy", "value": 0.96}})

    assert planner.bsp_steps_apply(job(0.02), at02) == (True, "")
    applies, why = planner.bsp_steps_apply(job(mid), between)
    assert not applies and "counted at lr 0.02 and 0.1, not between" in why, why
    assert planner.factors_apply(job(mid), between) == (True, "")  # the ratios still rank the policies
    old = tmp_path / "one.json"  # a file of one set, as written before there were several
    old.write_text(json.dumps({**fast, "applies_to": scope}))
    assert planner.load_factors(old, lr=0.02)["factors"]["local_sgd h=8"] == 0.9


def _sets(*points: tuple[float, int, dict[str, float], int]) -> dict:
    scope = {"workload": "orchestrator.workloads.digits", "optimizer": "sgd", "metric": "accuracy"}
    return {"applies_to": scope, "sets": [
        {"factors": {"bsp": 1.0, **f}, "bsp_steps": steps, "source": f"at {lr} with {n}",
         "measured_at": {"target": 0.96, "lr": lr, "workers": n, "global_batch": 32 * n}} for lr, n, f, steps in points]}


def test_the_factors_are_the_set_measured_at_the_jobs_world_size_or_interpolated_in_log_world_size(tmp_path):
    """How many replicas are averaged moves a periodic policy's steps relative to BSP's (on the digits MLP
    `diloco h=16` needed fewer steps than `streaming_diloco h=16 f=4` with 8 workers at lr 0.03, and more
    with 4 at lr 0.02), so the file holds sets per rate and world size. A job gets, at each measured world
    size, the factors at its rate (measured, or interpolated in log rate), then those of its world size, or
    f(n) = f_a + u (f_b - f_a) with u = ln(n / a) / ln(b / a) between two sizes a < n < b, and BSP's steps in
    log-log, which then say nothing of the job's length; outside the sizes measured, the nearest. Whether
    both the rate and the world size lie within those measured is `bracketed`. (Before, every job got the
    factors of 4 workers.)"""
    path = tmp_path / "convergence.json"
    path.write_text(json.dumps(_sets((0.1, 4, {"diloco h=16": 1.0}, 80), (0.02, 4, {"diloco h=16": 0.9}, 180),
                                     (0.1, 8, {"diloco h=16": 1.2}, 60), (0.02, 8, {"diloco h=16": 0.7}, 150))))
    assert planner.load_factors(path, lr=0.02, workers=8)["factors"]["diloco h=16"] == 0.7
    at8 = planner.load_factors(path, lr=0.1, workers=8)
    assert at8["bsp_steps"] == 60 and at8["bracketed"] and at8["measured_at"]["workers"] == 8
    mid_lr, six = 0.02 * 5 ** 0.5, 6  # half way in log(rate); log(6 / 4) / log(2) of the way from 4 to 8 workers
    u = math.log(6 / 4) / math.log(2)
    four, eight = 0.9 + 0.5 * (1.0 - 0.9), 0.7 + 0.5 * (1.2 - 0.7)
    both = planner.load_factors(path, lr=mid_lr, workers=six)
    assert abs(both["factors"]["diloco h=16"] - ((1 - u) * four + u * eight)) < 1e-12
    s4, s8 = math.sqrt(180 * 80), math.sqrt(150 * 60)
    assert abs(both["bsp_steps"] - math.exp((1 - u) * math.log(round(s4)) + u * math.log(round(s8)))) <= 0.5
    assert both["bracketed"] and "interpolated in log(world size) at 6 workers between 4 and 8" in both["source"]
    for n, near in ((2, 0.9), (16, 0.7)):
        outside = planner.load_factors(path, lr=0.02, workers=n)
        assert outside["factors"]["diloco h=16"] == near and not outside["bracketed"]
        assert "outside the world sizes measured (4, 8)" in outside["source"]
    assert not planner.load_factors(path, lr=0.5, workers=8)["bracketed"]  # a rate outside those measured

    def job(n: int) -> object:
        return cfg(workers={"count": n}, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9},
                   workload={**BASE["workload"], "batch_size": 32},
                   stop={"max_steps": 600, "target": {"metric": "accuracy", "value": 0.96}})

    assert planner.bsp_steps_apply(job(8), at8) == (True, "")
    applies, why = planner.bsp_steps_apply(job(6), planner.load_factors(path, lr=0.1, workers=6))
    assert not applies and "6 workers (BSP's steps were counted with 4 and 8, not between)" in why, why
    old = tmp_path / "rates.json"  # sets that do not say their world size: by rate alone, and not bracketed
    old.write_text(json.dumps({"applies_to": {}, "sets": [
        {"factors": {"bsp": 1.0}, "bsp_steps": 80, "measured_at": {"lr": 0.1}}]}))
    assert planner.load_factors(old, lr=0.1)["bracketed"] and not planner.load_factors(old, lr=0.1, workers=4)["bracketed"]


def test_a_periodic_policy_is_credited_with_fewer_steps_than_bsp_only_where_its_factors_were_measured(tmp_path,
                                                                                                       monkeypatch):
    """Where the factors were measured around the job's rate and world size, `local_sgd`, `diloco` and
    `streaming_diloco` keep a factor below 1 (their steps to the target are fixed by the rate, the world
    size and the seed, not by timing); elsewhere, and for `shadow` and gossip anywhere, a factor below 1
    counts as 1. The trial scores its candidates with these factors (measured step time x factor), so two
    candidates of about the same step time are told apart by their measured convergence. (Before, every
    relaxed factor counted as at least 1, and a trial between `diloco` at 0.8 and `streaming_diloco` at 0.9
    picked by step time alone.)"""
    c = cfg(network=LAB)
    cands = [x for x in planner.candidates(c) if x.label in ("bsp", "diloco h=16", "streaming_diloco h=16 f=4",
                                                           "shadow ma", "dpsgd ring")]
    net, size = planner.network_for(c.network, 4), 1.2e6
    factors = {"diloco h=16": 0.8, "streaming_diloco h=16 f=4": 0.9, "shadow ma": 0.5, "dpsgd ring": 0.6}
    got = {r.candidate.label: r.factor for r in planner.rank(cands, net, Compute(0.01), size, factors, 100, credit=True)}
    assert got == {"bsp": 1.0, "diloco h=16": 0.8, "streaming_diloco h=16 f=4": 0.9, "shadow ma": 1.0, "dpsgd ring": 1.0}
    off = {r.candidate.label: r.factor for r in planner.rank(cands, net, Compute(0.01), size, factors, 100)}
    assert off == {"bsp": 1.0, "diloco h=16": 1.0, "streaming_diloco h=16 f=4": 1.0, "shadow ma": 1.0, "dpsgd ring": 1.0}

    path = tmp_path / "convergence.json"
    path.write_text(json.dumps(_sets((0.1, 4, factors, 80), (0.02, 4, factors, 180))))
    real = planner.load_factors
    monkeypatch.setattr(planner, "load_factors", lambda **kw: real(path, **kw))
    monkeypatch.setattr(planner, "measure_host", lambda job, cands, nbytes, **_: {})

    def trial(lr: float) -> dict[str, float]:
        job = cfg(network=LAB, optimizer={"name": "sgd", "lr": lr, "momentum": 0.9},
                  stop={"max_steps": 600, "target": {"metric": "accuracy", "value": 0.96}},
                  sync={"policy": "auto", "candidates": ["diloco", "streaming_diloco"],
                        "auto": {"trial_steps": 10, "candidates": 2}})
        chosen, line, _ = planner.choose(job, compute_s=0.01, model_bytes=size)
        return {x["label"]: x["factor"] for x in chosen.policy_trial["candidates"]}, line

    measured, line = trial(0.05)
    assert measured == {"diloco h=16": 0.8, "streaming_diloco h=16 f=4": 0.9}, line
    assert "count with their factors as measured, below 1 too" in line
    outside, line = trial(0.5)
    assert outside == {"diloco h=16": 1.0, "streaming_diloco h=16 f=4": 1.0}, line
    assert "outside those measured, so no policy is credited" in line
