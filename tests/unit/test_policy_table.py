"""The policy table (core/schema/policies.py `POLICIES`): the one place a policy is declared. Every other list
derives from it, and a policy the runtime model or the planner forgot fails here instead of being
silently never considered by `auto`."""
from __future__ import annotations

import typing

from algorithms.policies.base import get_algorithm, known_policies
from algorithms.rules.kinds import KINDS, POLICY_KINDS
from algorithms.rules.runtime_model import Compute, Network, PolicySpec, predict
from core.schema import (
    COMPRESSING_POLICIES,
    POLICIES,
    SERVER_POLICIES,
    SYNC_POLICIES,
    SyncConfig,
)
from orchestrator import planner
from orchestrator.config import config_from_dict


def test_the_schema_the_kinds_and_the_registry_are_the_tables_rows():
    names = [row.name for row in POLICIES]
    assert len(set(names)) == len(names)
    assert list(SYNC_POLICIES) == names and list(POLICY_KINDS) == names
    assert sorted(known_policies()) == sorted(names)  # each row's module registers its class
    for row in POLICIES:
        assert get_algorithm(row.name).kind is KINDS[row.kind] and row.knobs.policy == row.name
        assert (row.name in SERVER_POLICIES) == row.server and (row.name in COMPRESSING_POLICIES) == row.codec
    assert {row.knobs for row in POLICIES} <= set(typing.get_args(SyncConfig))  # the type checker's union


def test_every_policy_outside_the_parameter_server_has_a_cost_model_and_a_place_in_the_planner():
    """The runtime model predicts each one, and `plan`/`auto` weigh it for some job (SGD or AdamW, on
    a lab network of two nodes)."""
    net = Network.uniform(2, 2, 1.25e8, 1e-4)
    base = {"name": "t", "workers": {"count": 4}, "workload": {"factory": "orchestrator.workloads.digits:mlp"},
            "network": {"nodes": 2, "workers_per_node": 2}}
    weighed = set()
    for optimizer in ({"name": "sgd", "lr": 0.1}, {"name": "adamw", "lr": 0.003}):
        weighed |= {c.sync["policy"] for c in planner.candidates(config_from_dict({**base, "optimizer": optimizer}))}
    for row in POLICIES:
        if row.server:
            assert row.cost_model is None and not row.weighed and row.name not in weighed  # Ray's traffic: neither modelled nor weighed
            continue
        assert row.cost_model is not None, f"{row.name} has no cost model"
        assert row.weighed, f"{row.name} has no configuration for the planner to weigh"
        assert predict(PolicySpec(row.name, h=4), net, Compute(0.01), 1e6).step_s > 0
        assert row.name in weighed, f"the planner never weighs {row.name}"
