"""What each policy kind means to the control plane, without torch.

The coordinator decides from a policy's kind alone (who reports history, how a membership epoch
is entered, what the final model is, whether a server actor runs), so this module is all it
imports of the policies: importing torch would cost every job's start about two seconds before
its first worker is asked for. The worker side (`algorithms/policies/base.py` and the policies) builds on
the same tables; `tests/unit/test_kinds.py` checks `POLICY_KINDS` against the registry.
"""
from __future__ import annotations

from typing import Literal, cast

from core.schema import POLICIES

Kind = Literal["synchronous", "periodic", "server", "decentralized", "background"]
Entry = Literal["replicated", "average", "server", "none"]
Reporter = Literal["rank0", "each", "server"]

ENTRY: dict[str, Entry] = {"synchronous": "replicated", "periodic": "replicated", "server": "server",
                           "decentralized": "average", "background": "none"}
REPORTER: dict[str, Reporter] = {"synchronous": "rank0", "periodic": "rank0", "server": "server",
                                 "decentralized": "each", "background": "each"}
FINAL_MODEL: dict[str, Literal["rank0", "server", "average"]] = {
    "synchronous": "rank0", "periodic": "rank0", "server": "server", "decentralized": "average", "background": "average"}
SERVER_KINDS = frozenset({"server", "background"})
"""Kinds whose job runs a server actor: the parameter server, or the background kind's lease dispenser."""
LOCAL_MEAN = frozenset({"periodic", "decentralized", "background"})
"""Kinds whose members update their own replica: each uses its mean loss. The others weight each
member's loss by its share of the global batch, so that summing is the global-batch mean."""

POLICY_KINDS: dict[str, Kind] = {row.name: cast(Kind, row.kind) for row in POLICIES}
"""Every built-in policy's kind, from the policy table (core/schema/policies.py `POLICIES`); each policy class
declares the same as its `kind`."""


class KindTraits:
    """The kind-derived answers; `Algorithm` has them, and the coordinator holds just these."""

    kind: Kind

    @property
    def entry(self) -> Entry:
        return ENTRY[self.kind]

    @property
    def reporter(self) -> Reporter:
        return REPORTER[self.kind]

    @property
    def local_mean(self) -> bool:
        return self.kind in LOCAL_MEAN

    @property
    def final_model(self) -> str:
        return FINAL_MODEL[self.kind]

    @property
    def counts_steps(self) -> bool:
        """Whether a worker's own step counts toward `stop.max_steps` (server kinds count versions)."""
        return self.kind != "server"


class PolicyTraits(KindTraits):
    """A policy as the coordinator sees it: its name and kind."""

    def __init__(self, name: str) -> None:
        if name not in POLICY_KINDS:
            raise KeyError(f"unknown policy {name!r}; available: {', '.join(sorted(POLICY_KINDS))}")
        self.name = name
        self.kind = POLICY_KINDS[name]

    def __repr__(self) -> str:
        return f"PolicyTraits({self.name!r}, kind={self.kind!r})"
