"""Storage credentials are never written down (issue: a run's config.yaml, Ray's KV store and the actors'
arguments held the keys of a URI's query): the config keeps the name of an environment variable."""
from __future__ import annotations

import os

import pytest
import yaml

from actors.runs.storage import StorageError, move_credentials, open_storage, redact
from orchestrator.config import config_from_dict

URI = "s3://bucket/runs?endpoint_override=http://127.0.0.1:9&scheme=http"


def test_credentials_in_the_uri_move_to_the_environment_and_out_of_the_config(monkeypatch):
    for name in ("ORCHESTRATOR_STORAGE_ACCESS_KEY", "ORCHESTRATOR_STORAGE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the config sets stays in this test
    cfg = config_from_dict({"name": "creds", "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                            "stop": {"max_steps": 1}, "storage": URI + "&access_key=AKIAVISIBLE&secret_key=s3cr3t"})
    written = yaml.safe_dump(cfg.to_dict())
    assert "AKIAVISIBLE" not in written and "s3cr3t" not in written, written
    assert cfg.storage == URI
    assert cfg.storage_options == {"access_key": "ORCHESTRATOR_STORAGE_ACCESS_KEY",
                                   "secret_key": "ORCHESTRATOR_STORAGE_SECRET_KEY"}
    assert os.environ["ORCHESTRATOR_STORAGE_SECRET_KEY"] == "s3cr3t"
    assert open_storage(cfg.storage, cfg.storage_options).remote


def test_a_named_variable_that_is_not_set_is_one_line(monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(StorageError, match="storage_options.access_key names the environment variable NOT_SET_ANYWHERE"):
        open_storage(URI, {"access_key": "NOT_SET_ANYWHERE"})


def test_storage_options_name_variables_not_values():
    from core.schema import ConfigError

    with pytest.raises(ConfigError, match="storage_options.secret_key"):
        config_from_dict({"name": "creds", "workload": {"factory": "orchestrator.workloads.digits:mlp"},
                          "stop": {"max_steps": 1}, "storage": URI, "storage_options": {"secret_key": "abc/def+ghi="}})


def test_redact_and_a_uri_without_credentials_is_left_alone():
    assert redact(URI + "&secret_key=s3cr3t") == URI + "&secret_key=***"
    assert move_credentials(URI) == (URI, {}, {})
