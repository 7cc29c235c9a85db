"""Every kind of policy fits the seam: a fake policy of each kind the core does not ship yet (server,
decentralized, background) runs through the real replica loop, in process, without Ray, and the
seam decides who reports history, who stops, how losses are weighted and how an epoch is entered."""
from __future__ import annotations

import dataclasses
import threading
from typing import Literal

import pytest
import torch

from actors.plan import Progress
from algorithms.policies import base
from algorithms.policies.base import Algorithm, AlgorithmImpl, StepVote, VoteDraft
from algorithms.rules.kinds import BACKGROUND, DECENTRALIZED, KINDS, SERVER, Entry, FinalModel, Kind
from core import schema
from testkit.harness import LocalJob


# ------------------------------------------------------------------ fakes
@dataclasses.dataclass
class FakeConfig:
    policy: str = "fake"


class FakeServer:
    """A parameter server in process: applies each pushed gradient at once, counts versions, reports them."""

    def __init__(self, model: torch.nn.Module, link, max_versions: int) -> None:
        self.params = [p.detach().clone() for p in model.parameters()]
        self.version, self.max_versions, self.link = 0, max_versions, link
        self.lock = threading.Lock()

    def push_pull(self, grads: list[torch.Tensor], lr: float, loss: float) -> list[torch.Tensor]:
        with self.lock:
            if self.version < self.max_versions:
                for p, g in zip(self.params, grads):
                    p.sub_(lr * g)
                self.version += 1
                self.link.report(Progress("server", self.version, 1, 0.0, ({"step": self.version, "loss": loss, "time": 0.0},)), False)
            return [p.clone() for p in self.params]


SERVERS: dict[str, FakeServer] = {}


class FakeServerImpl(AlgorithmImpl):
    def apply_update(self, step: int, lr: float) -> None:
        server = SERVERS["job"]
        fresh = server.push_pull([p.grad.clone() for p in self.model.parameters()], lr, 0.0)
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), fresh):
                p.copy_(v)
        for p in self.model.parameters():
            p.grad = None

    def stop_requested(self) -> bool:
        return SERVERS["job"].version >= SERVERS["job"].max_versions


class FakeGossipImpl(AlgorithmImpl):
    """Decentralized: after the local step, average with everyone (a complete topology)."""

    def finish_step(self, step: int, draft: VoteDraft) -> StepVote:
        return StepVote(True, draft.loss, draft.samples, draft.newer_plan, communicated=True)

    def apply_update(self, step: int, lr: float) -> None:
        super().apply_update(step, lr)
        for p in self.model.parameters():
            self.comm.all_reduce(p.data).wait()
            p.data /= self.comm.world_size


class FakeBackgroundImpl(AlgorithmImpl):
    """Background: the foreground only takes local steps (its rounds would run on their own thread).
    The kind's job has a lease dispenser and a group factory, which this fake takes and leaves unused."""

    def connect(self, client, slot, incarnation):
        pass

    def attach(self, make_group, save_state, load_state, on_failure, on_state=None):
        pass


def fake(name: str, kind: Kind, impl: type) -> type:
    cfg = dataclasses.make_dataclass(f"{name}_config", [("policy", Literal[name], name)])  # type: ignore[valid-type]
    algo = type(name, (Algorithm,), {"name": name, "kind": kind, "impl": impl})
    return cfg, algo


@pytest.fixture
def fakes():
    made = {n: fake(n, k, i) for n, k, i in [("fake_server", SERVER, FakeServerImpl),
                                              ("fake_gossip", DECENTRALIZED, FakeGossipImpl),
                                              ("fake_background", BACKGROUND, FakeBackgroundImpl)]}
    base._load_builtin()
    for name, (cfg, algo) in made.items():
        schema.SYNC_POLICIES[name] = cfg
        base._REGISTRY[name] = algo
    yield
    for name in made:
        schema.SYNC_POLICIES.pop(name)
        base._REGISTRY.pop(name)


def job(tmp_path, policy: str, n: int = 3, steps: int = 10) -> LocalJob:
    cfg = {"name": "kinds", "seed": 1, "workers": {"count": n, "cpus": 1},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 8},
           "optimizer": {"lr": 0.1}, "sync": {"policy": policy}, "stop": {"max_steps": steps}, "eval_every": 0}
    return LocalJob(cfg, [f"w{i}" for i in range(n)], str(tmp_path))


# ------------------------------------------------------------------ the kinds
def test_decentralized_kind_every_member_reports_and_stops_at_its_own_step(tmp_path, fakes):
    j = job(tmp_path, "fake_gossip")
    j.run(("w0", "w1", "w2"), 24)
    by_slot = {s: [r["step"] for r in j.link.records if r.get("slot") == s] for s in ("w0", "w1", "w2")}
    assert by_slot == {s: list(range(1, 11)) for s in by_slot}, "each member reports each of its steps once"
    replica = j.replicas["w1"]
    assert replica.policy.algorithm.entry is Entry.AVERAGE and replica.policy.algorithm.local_mean
    assert replica.policy.algorithm.final_model is FinalModel.AVERAGE
    assert not any(name == "epoch_agreed" for name, _ in j.link.calls), "no replicated agreement for this kind"
    params = [j.parameters(s) for s in ("w0", "w1", "w2")]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params[0], params[1])), "gossip with everyone mixes fully"


def test_background_kind_never_waits_on_others_and_reports_per_member(tmp_path, fakes):
    j = job(tmp_path, "fake_background", steps=6)
    j.run(("w0", "w1"), 16)
    assert sorted({r["slot"] for r in j.link.records}) == ["w0", "w1"]
    assert all(r["step"] <= 6 for r in j.link.records)
    assert j.replicas["w0"].policy.algorithm.entry is Entry.NONE
    assert not torch.equal(j.parameters("w0")[0], j.parameters("w1")[0]), "replicas update on their own"


def test_server_kind_the_server_reports_and_says_when_to_stop(tmp_path, fakes):
    j = job(tmp_path, "fake_server", n=2, steps=7)
    SERVERS["job"] = FakeServer(j.replicas["w0"].training.model, j.link, max_versions=7)
    outcomes = j.run(("w0", "w1"), 16)
    assert {r.get("step") for r in j.link.records} == set(range(1, 8)) and all("slot" not in r for r in j.link.records)
    assert SERVERS["job"].version == 7
    assert sum(o.step for o in outcomes.values()) >= 7, "workers count their own pushes, not the job's steps"
    replica = j.replicas["w0"]
    algorithm = replica.policy.algorithm
    assert not algorithm.local_mean and algorithm.final_model is FinalModel.SERVER and replica.policy.max_steps is None


def test_every_kind_maps_to_entry_reporter_and_loss_weighting():
    assert set(KINDS) == {"synchronous", "periodic", "server", "decentralized", "background"}
    assert all(isinstance(k.entry, Entry) and isinstance(k.final_model, FinalModel) for k in KINDS.values())
    assert {name for name, k in KINDS.items() if k.local_mean} == {"periodic", "decentralized", "background"}


def test_the_schema_and_the_registry_know_the_same_policies():
    """Every policy the schema accepts runs: the registry has it. A policy in schema.NOT_WIRED (settings
    checked, no actors yet; none today) is refused by the schema and must not be registered before it
    can run."""
    assert sorted(set(schema.SYNC_POLICIES) - schema.NOT_WIRED) == base.known_policies()
    assert schema.NOT_WIRED <= set(schema.SYNC_POLICIES) and not schema.NOT_WIRED & set(base.known_policies())
