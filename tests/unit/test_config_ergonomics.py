"""Config ergonomics: a misspelt key names the nearest; the keys the job sets itself are neither listed nor
accepted from a config; every key a user can set is in docs/configuration.md; `events()` filters by kind
and the notebook's list of newest events is not buried under checkpoints."""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from core.schema import (
    SYNC_POLICIES,
    AutoConfig,
    ConfigError,
    Event,
    JobConfig,
    JobStatus,
    SyncConfig,
    nearest,
    parse,
    user_keys,
)
from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob

REPO = Path(__file__).resolve().parents[2]
BASE = {"name": "ergo", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 5}}


def refusal(**over) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, **over})
    return str(err.value)


def test_nearest_is_the_closest_choice_case_ignored_or_none():
    assert nearest("eval_evry", ["seed", "eval_every", "name"]) == "eval_every"
    assert nearest("adagrad", ["Adam", "Adagrad"]) == "Adagrad"
    assert nearest("zzz", ["seed", "name"]) is None


def test_an_unknown_key_names_the_nearest_allowed_one():
    line = refusal(eval_evry=10)
    assert line.startswith("eval_evry: unknown key; did you mean eval_every? (allowed here: name, seed, workers, "), line
    assert refusal(workers={"cont": 2}).startswith("workers.cont: unknown key; did you mean count? (allowed here: count,")
    assert refusal(sync={"policy": "local_sgd", "hh": 4}) == \
        "sync.hh: is not a knob of policy 'local_sgd'; did you mean h? (its knobs: policy, h)"
    assert refusal(zzzz=1).startswith("zzzz: unknown key; allowed here: name, "), "no near key: the list alone"


def test_the_keys_the_job_sets_itself_are_not_listed_and_a_config_that_sets_them_is_refused():
    assert "policy_choice" not in refusal(eval_evry=1) and "policy_trial" not in refusal(eval_evry=1)
    assert refusal(policy_choice="bsp") == ("policy_choice: is set by the job itself when sync.policy: auto picks (a "
                                            "run's config.yaml records it), never by a config; remove it")
    assert refusal(policy_trial={"steps": 5}).startswith("policy_trial: is set by the job itself")
    resolved = parse(JobConfig, {**BASE, "policy_choice": "picked bsp"}).to_dict()
    assert config_from_dict({**resolved, "policy_choice": "", "policy_trial": {}}).name == "ergo", \
        "a resolved config.yaml without auto (empty values) still runs"
    assert parse(JobConfig, resolved).policy_choice == "picked bsp", "the actors' own parse takes them"


def test_a_ray_namespace_other_than_the_one_the_driver_uses_is_refused():
    assert refusal(ray={"namespace": "mine"}).startswith("ray.namespace: only orchestrator works")


# ------------------------------------------------------------------ every key in docs/configuration.md
def _sections(tp: typing.Any) -> list[type]:
    """The dataclasses a field's type holds keys of (a policy's knobs under `sync`, both optimizer kinds)."""
    if tp is SyncConfig:
        return [*SYNC_POLICIES.values(), AutoConfig]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return [cls for arg in typing.get_args(tp) for cls in _sections(arg)]


def user_key_paths(cls: type = JobConfig, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    hints = typing.get_type_hints(cls)
    paths = set()
    for name in user_keys(cls):
        paths.add((*prefix, name))
        for section in _sections(hints[name]):
            paths |= user_key_paths(section, (*prefix, name))
    return paths


def documented_rows() -> list[set[str]]:
    """Each row of configuration.md's key table as the names written in backticks in it (a row documents
    `workers.count` / `min` / `max`, `stop.target: {metric, value, mode}`, a policy's knobs in its cell)."""
    text = (REPO / "docs" / "configuration.md").read_text()
    return [set(re.findall(r"[A-Za-z_]\w*", " ".join(re.findall(r"`([^`]*)`", row))))
            for row in text.splitlines() if row.startswith("| `")]


def test_every_key_a_user_can_set_is_in_configuration_md():
    paths = user_key_paths()
    assert ("progress_every_s",) in paths and ("optimizer", "args") in paths and ("sync", "outer_lr") in paths
    assert ("policy_choice",) not in paths, "the job's own keys are not a user's"
    rows = documented_rows()
    missing = sorted(".".join(p) for p in paths if not any(set(p) <= row for row in rows))
    assert not missing, f"keys a config may set that docs/configuration.md's table does not name: {missing}"


# ------------------------------------------------------------------ events
EVENTS = [Event(1.0, "transition", "STARTING -> RUNNING"), Event(2.0, "checkpoint", "checkpoint at step 10"),
          Event(3.0, "reshape", "w1 died"), *[Event(4.0 + i, "checkpoint", f"checkpoint at step {20 + 10 * i}")
                                              for i in range(8)], Event(20.0, "failure", "w0 raised")]


@pytest.fixture
def ended_job(tmp_path) -> ElasticJob:
    job = ElasticJob(config_from_dict(BASE))
    job.run_dir = tmp_path
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e.to_dict()) + "\n" for e in EVENTS))
    return job


def test_events_returns_every_event_by_default_or_those_of_the_kinds_asked(ended_job):
    assert [e["kind"] for e in ended_job.events()] == [e.kind for e in EVENTS], "every event, oldest first"
    assert [e["reason"] for e in ended_job.events("reshape")] == ["w1 died"]
    assert [e["kind"] for e in ended_job.events(["failure", "transition"])] == ["transition", "failure"]
    assert [e["kind"] for e in ended_job.events(("reshape",))] == ["reshape"]
    assert ended_job.events("no_such_kind") == []


def test_the_notebooks_newest_events_are_not_buried_under_checkpoints(ended_job, monkeypatch):
    status = JobStatus(name="ergo", run_id="r", state="FAILED", step=100, membership_epoch=2, world_size=1,
                       members=(), loss=None, throughput=None, cause="w0 raised", run_dir=str(ended_job.run_dir))
    monkeypatch.setattr(ended_job, "status", lambda: status)
    shown = ended_job._view()[1]
    assert [e["kind"] for e in shown] == ["transition", "reshape", "failure"]
    html = ended_job._repr_html_()
    assert "w1 died" in html and "STARTING -&gt; RUNNING" in html and "checkpoint at step" not in html
