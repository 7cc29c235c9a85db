"""A worker process's environment (actors/control/workers.py: `worker_process_env`): glibc's huge-page
tunable added to what the user set, never over the user's own choice of it, and nothing when off."""
from __future__ import annotations

from actors.control.workers import HUGE_PAGES_TUNABLE, worker_process_env
from orchestrator.config import config_from_dict

BASE = {"name": "env", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 1}}


def config(huge_pages: bool | None = None):
    raw = dict(BASE)
    if huge_pages is not None:
        raw["workers"] = {"huge_pages": huge_pages}
    return config_from_dict(raw)


def test_huge_pages_are_on_by_default_and_join_the_users_tunables():
    assert worker_process_env(config(), inherited="") == {"GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}
    assert worker_process_env(config(), inherited="glibc.malloc.arena_max=2") == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}"}


def test_the_users_own_hugetlb_setting_stands_and_off_sets_nothing():
    assert worker_process_env(config(), inherited="glibc.malloc.hugetlb=0") == {}
    assert worker_process_env(config(False), inherited="") == {}
