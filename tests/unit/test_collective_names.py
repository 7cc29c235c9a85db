"""`orchestrator.collective_group()` outside a worker's epoch, and under a policy with no group,
says why there is no group (without Ray)."""
from __future__ import annotations

import pytest

from actors.transport import collective
from actors.transport.comm import GroupSpec, NoGroup
from orchestrator import collective_group


def test_outside_a_worker_there_is_no_group_and_the_error_says_so(monkeypatch):
    # a process that never was a worker (tests before this one in the same process may have published)
    monkeypatch.setattr(collective, "_current", None)
    monkeypatch.setattr(collective, "_no_group_reason", collective.NOT_A_WORKER)
    with pytest.raises(RuntimeError, match="not a worker of a running membership epoch|epoch ended"):
        collective_group()


def test_a_server_policy_has_no_group_and_the_error_names_the_policy():
    collective.publish(NoGroup(GroupSpec("h", 1, "job/r/c0/e1", 0, 2, 5.0)), "ssp")
    with pytest.raises(RuntimeError, match="policy 'ssp' forms no collective group"):
        collective_group()
