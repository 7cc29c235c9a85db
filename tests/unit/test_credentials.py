"""Storage credentials are never written down (issue: a run's config.yaml, Ray's KV store and the actors'
arguments held the keys of a URI's query): the config keeps the name of an environment variable."""
from __future__ import annotations

import os

import pytest
import yaml

from actors.runs import credentials
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
    assert credentials.value("ORCHESTRATOR_STORAGE_SECRET_KEY") == "s3cr3t", "held in this process's memory"
    assert "ORCHESTRATOR_STORAGE_SECRET_KEY" not in os.environ, \
        "not in the environment, which every process this one starts (a local Ray's) inherits"
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


@pytest.mark.parametrize("option", ["api_key", "aws_secret_access_key", "passphrase", "sas_token", "client_secret",
                                    "refresh_token", "Authorization", "my_weird_option"])
def test_only_known_settings_stay_in_the_uri(option):
    """An allow-list, not a deny-list: an option the orchestrator does not know to be a setting is treated
    as a credential, moved out and redacted (a passphrase or an api_key stayed in the URI before, and
    with it in the config file, the bucket's config.yaml, Ray's KV record and command lines)."""
    uri = f"{URI}&{option}=FAKESECRET123"
    kept, options, values = move_credentials(uri)
    assert "FAKESECRET123" not in kept and kept == URI, kept
    assert options == {option: credentials.moved_name(option)} and values == {credentials.moved_name(option): "FAKESECRET123"}
    assert "FAKESECRET123" not in (redact(uri) or "")


@pytest.mark.parametrize("uri, moved", [
    ("s3://AKIAUSER:s3cr3tpass@bucket/runs?scheme=http", {"access_key": "AKIAUSER", "secret_key": "s3cr3tpass"}),
    ("sftp://someone:hunter2@host:2222/runs", {"password": "hunter2"}),
])
def test_a_user_and_password_in_the_uri_leave_it(uri, moved):
    kept, options, values = move_credentials(uri)
    assert "@" not in kept and all(v not in kept for v in moved.values()), kept
    assert {o: values[credentials.moved_name(o)] for o in options} == moved
    shown = redact(uri) or ""
    assert all(v not in shown for v in moved.values() if v != "someone"), shown


def test_settings_stay_and_a_setting_named_like_a_secret_does_not():
    uri = "s3://bucket/runs?endpoint_override=127.0.0.1:9&scheme=http&region=eu-west-1&anonymous=false"
    assert move_credentials(uri) == (uri, {}, {})
    assert redact(uri) == uri


def test_a_credential_that_did_not_reach_the_process_is_one_line(monkeypatch):
    monkeypatch.setattr(credentials, "_held", {})
    with pytest.raises(StorageError, match="the credential secret_key taken out of the storage URI did not reach this"):
        open_storage(URI, {"secret_key": credentials.moved_name("secret_key")})


def test_a_bundle_carries_only_the_moved_credentials_the_config_names(monkeypatch):
    monkeypatch.setattr(credentials, "_held", {})
    credentials.hold({"ORCHESTRATOR_STORAGE_SECRET_KEY": "s", "ORCHESTRATOR_STORAGE_OTHER": "o"})
    blob = credentials.bundle({"secret_key": "ORCHESTRATOR_STORAGE_SECRET_KEY", "access_key": "MY_OWN_VARIABLE"})
    monkeypatch.setattr(credentials, "_held", {})
    credentials.receive(blob)
    assert credentials._held == {"ORCHESTRATOR_STORAGE_SECRET_KEY": "s"}
    assert credentials.bundle({"access_key": "MY_OWN_VARIABLE"}) is None
