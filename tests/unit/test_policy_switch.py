"""A policy switched mid-run (the online trial of `sync.auto`; actors/control/trial.py publishes it, the
replicas switch at the commit point where they adopt the plan): real replicas in threads over in-process
gloo, no Ray, against plain-torch references written here from the rules (BSP: one optimizer step on
the mean gradient of each global batch; local SGD: each member's own optimizer on its share, the
replicas averaged every h steps; at a switch every member takes rank 0's state)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from testkit.harness import LocalJob, committed_samples, paced, wait_until
from tests.unit.test_policy_oracles import SEED, global_batch_ids, share, start_model

BATCH, N = 8, 4
OPT = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
SLOTS = tuple(f"w{i}" for i in range(N))


def config(sync: dict) -> dict:
    return paced({"name": "switch", "seed": SEED, "workers": {"count": N, "cpus": 1},
                  "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 16}, "batch_size": BATCH},
                  "optimizer": OPT, "sync": sync, "stop": {"max_steps": 1_000_000}, "eval_every": 0}, 0.02)


def policy(label: str, sync: dict, fresh: bool) -> dict:
    return {"label": label, "sync": sync, "compression": {"codec": "none"}, "fresh": fresh}


def run_switched(tmp_path, first: dict, then: dict, label: str, nodes: tuple[str, ...] = ()) -> tuple[LocalJob, int, int]:
    """Train under `first`; once w0 passed step 5, publish `then` (fresh) as the trial does; once a step
    committed under it, publish it again (no longer fresh) with a stop 6 steps on. Returns the job, the
    switch's commit point (the last step under `first`) and the last step."""
    job = LocalJob(config(first), list(SLOTS), str(tmp_path))
    gb = N * BATCH
    job.publish(SLOTS, 1, gb)
    job.start()
    wait_until(lambda: job.replicas["w0"].training.step >= 5, what="step 5")
    job.publish(SLOTS, 2, gb, policy=policy(label, then, fresh=True), nodes=nodes)
    wait_until(lambda: any(r.get("policy") == label for r in job.link.records) or
               any(rep.reporter.kept and rep.reporter.kept[-1].get("policy") == label for rep in job.replicas.values()),
               what="a step committed under the new policy")
    # the switch's commit point: the step the new epoch's members agreed on (a periodic policy records
    # only its rounds, so its first record is not the step after the switch)
    # (rank 0 sends its agreement with its next report, which may come after a member kept such a step)
    switched = wait_until(lambda: next((args[1] for name, args in job.link.calls if name == "epoch_agreed"
                                        and args[0] == 2), None), what="the switch's epoch agreement")
    stop = job.replicas["w0"].training.step + 6
    job.publish(SLOTS, 3, gb, policy=policy(label, then, fresh=False), nodes=nodes, stop_step=stop)
    outcomes = job.wait(120)
    assert all(o.ok for o in outcomes.values()), outcomes
    return job, switched, stop


def start():
    """The oracles' starting model (seed 3, 16 hidden units) and the data, with SGD and momentum."""
    model, x, y = start_model()
    return model, torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"]), x, y


def bsp_steps(model, opt, x, y, first: int, last: int) -> None:
    for step in range(first, last):
        index = torch.tensor(global_batch_ids(step, N * BATCH, len(x)))
        opt.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        opt.step()


def local_sgd_steps(replicas, opts, x, y, first: int, last: int, h: int, stop: int | None) -> None:
    """Steps first..last-1 (0-based) of local SGD: each replica's optimizer on its share; after every
    step that is a multiple of h, and at the stop, the replicas' mean (equal shares: the plain mean)."""
    for step in range(first, last):
        ids = global_batch_ids(step, N * BATCH, len(x))
        for rank, (m, opt) in enumerate(zip(replicas, opts)):
            index = torch.tensor(share(ids, rank, N))
            opt.zero_grad()
            F.cross_entropy(m(x[index]), y[index]).backward()
            opt.step()
        if (step + 1) % h == 0 or step + 1 == stop:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in replicas)):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)


def assert_replicas_equal(job: LocalJob) -> list[torch.Tensor]:
    params = job.parameters("w0")
    for slot in SLOTS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, job.parameters(slot))), f"{slot} differs from w0"
    return params


def max_diff(a, b) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a, b))


def test_bsp_switched_to_hierarchical_bsp_equals_single_process_sgd(tmp_path):
    """Both exact: the switched run is single-process SGD with momentum on the global batches (1e-6)."""
    job, switched, stop = run_switched(tmp_path, {"policy": "bsp"},
                                       {"policy": "bsp", "hierarchical": True, "engine": "python"}, "bsp hierarchical",
                                       nodes=("a", "a", "b", "b"))
    steps = sorted(r["step"] for r in job.link.records)
    assert steps == list(range(1, stop + 1)), steps  # every step committed once, through the switch
    assert 5 <= switched < stop and job.replicas["w0"].policy.algorithm.config.hierarchical
    model, opt, x, y = start()
    bsp_steps(model, opt, x, y, 0, stop)
    diff = max_diff(assert_replicas_equal(job), list(model.parameters()))
    print(f"switched after step {switched}, stopped at {stop}: max abs diff {diff:.2e}")
    assert diff <= 1e-6


def test_local_sgd_switched_to_bsp_takes_rank0s_optimizer_state(tmp_path):
    """Local SGD (h=4) until a round, then BSP: at the switch each member's own momentum is replaced by
    rank 0's (the plan is fresh), so the replicas stay equal and follow the reference: local SGD, then
    rank 0's replica and optimizer running single-process SGD on the global batches."""
    h = 4
    job, switched, stop = run_switched(tmp_path, {"policy": "local_sgd", "h": h}, {"policy": "bsp"}, "bsp")
    assert switched % h == 0, f"the switch landed at step {switched}, not at a round"
    model, _, x, y = start()
    replicas = [copy.deepcopy(model) for _ in range(N)]
    opts = [torch.optim.SGD(m.parameters(), lr=OPT["lr"], momentum=OPT["momentum"]) for m in replicas]
    local_sgd_steps(replicas, opts, x, y, 0, switched, h, stop=None)
    bsp_steps(replicas[0], opts[0], x, y, switched, stop)
    diff = max_diff(assert_replicas_equal(job), list(replicas[0].parameters()))
    print(f"local_sgd until step {switched}, bsp to {stop}: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_bsp_switched_to_local_sgd_commits_from_the_switch_step_and_follows_its_reference(tmp_path):
    """BSP, then local SGD (h=4) from the switch: its first committed state is the switch's step (a
    fresh periodic policy counted from step 0, and the next epoch agreed on step 0, below the committed
    step: the job failed). Reference: single-process SGD to the switch, then each member's copy of the
    optimizer on its share, the replicas averaged after every step that is a multiple of h and at the stop."""
    h = 4
    job, switched, stop = run_switched(tmp_path, {"policy": "bsp"}, {"policy": "local_sgd", "h": h}, "local_sgd")
    model, opt, x, y = start()
    bsp_steps(model, opt, x, y, 0, switched)
    replicas = [copy.deepcopy(model) for _ in range(N)]
    opts = []
    for m in replicas:
        o = torch.optim.SGD(m.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
        o.load_state_dict(copy.deepcopy(opt.state_dict()))  # every member starts from the shared momentum, its own copy
        opts.append(o)
    local_sgd_steps(replicas, opts, x, y, switched, stop, h, stop=stop)
    diff = max_diff(assert_replicas_equal(job), list(replicas[0].parameters()))
    print(f"bsp until step {switched}, local_sgd to {stop}: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_a_switch_reached_by_an_abort_mid_round_redoes_the_provisional_local_steps_under_the_new_policy(tmp_path):
    """A periodic member can meet a new plan between rounds (its round's collective aborted, as at a
    death): its local steps since the last round are provisional, so a switch there rewinds them and the
    new policy trains those steps again. Here no round ever committed, so the run's committed steps are
    BSP's from step 0: every sample of every step is in the ledger once, and the replicas agree
    (keeping the local steps made rank 0's unaveraged replica everyone's and lost the others' samples).
    Not equal to single-process SGD: a periodic rewind restores the parameters, not the inner
    optimizer's momentum (algorithms/policies/periodic.py), and the switch gives everyone rank 0's."""
    cfg = config({"policy": "local_sgd", "h": 8})
    cfg["faults"] = {**cfg["faults"], "record_samples": True}
    job = LocalJob(cfg, list(SLOTS), str(tmp_path))
    gb = N * BATCH
    job.publish(SLOTS, 1, gb)
    job.start()
    wait_until(lambda: min(r.training.step for r in job.replicas.values()) >= 3, what="three local steps")
    job.publish(SLOTS, 2, gb, policy=policy("bsp", {"policy": "bsp"}, fresh=True))
    for replica in job.replicas.values():
        replica.abort_epoch(1, "a switch mid-round")  # the round at step 8 fails: the members go to plan 2 from there
    wait_until(lambda: all(any(r.get("policy") == "bsp" for r in rep.reporter.kept) for rep in job.replicas.values()),
               what="a step committed under bsp")
    stop = job.replicas["w0"].training.step + 4
    job.publish(SLOTS, 3, gb, policy=policy("bsp", {"policy": "bsp"}, fresh=False), stop_step=stop)
    outcomes = job.wait(120)
    assert all(o.ok for o in outcomes.values()), outcomes
    _, _, x, _ = start()
    assert_replicas_equal(job)
    ledger = committed_samples(tmp_path, job.link.records)
    assert sorted(ledger) == list(range(1, stop + 1)), sorted(ledger)
    assert all(sorted(ledger[s]) == sorted(global_batch_ids(s - 1, gb, len(x))) for s in ledger), "a step's samples"
    assert [r["step"] for r in sorted(job.link.records, key=lambda r: r["step"])] == list(range(1, stop + 1))
