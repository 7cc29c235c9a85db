"""Config loading and defaults, without Ray."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from algorithms.policies.optim import lr_at
from core.schema import ConfigError, OptimizerConfig
from orchestrator.config import config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
MINIMAL = {"name": "m", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 3}}


def test_shipped_configs_load():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert load_config(path).name


def test_defaults_match_the_design():
    cfg = config_from_dict(MINIMAL)
    assert (cfg.workers.count, cfg.workers.min, cfg.workers.max, cfg.workers.cpus, cfg.workers.gpus) == (2, 1, 2, 1.0, 0.0)
    assert cfg.workload.params == {} and cfg.workload.batch_size == 32
    opt = cfg.optimizer
    assert (opt.name, opt.momentum, opt.weight_decay, opt.nesterov, opt.schedule, opt.warmup_steps) == \
        ("sgd", 0.0, 0.0, False, "constant", 0)
    assert cfg.sync.policy == "bsp" and cfg.compression.codec == "none"
    assert cfg.checkpoint.every_steps is None
    assert cfg.faults.kills == [] and cfg.faults.stragglers == []
    assert cfg.comm.timeout_s == 10.0


def test_list_and_dict_overrides():
    cfg = config_from_dict(MINIMAL, ["workers.count=3", "optimizer.lr=0.05", "stop.max_steps=7", "workload.params.hidden=16"])
    assert (cfg.workers.count, cfg.workers.max, cfg.optimizer.lr, cfg.stop.max_steps) == (3, 3, 0.05, 7)
    assert cfg.workload.params == {"hidden": 16}
    cfg = config_from_dict(MINIMAL, {"checkpoint.every_steps": 5})
    assert cfg.checkpoint.every_steps == 5


def test_int_accepted_where_a_float_is_expected():
    assert config_from_dict(MINIMAL, ["optimizer.lr=1"]).optimizer.lr == 1.0


@pytest.mark.parametrize("override,key", [
    ("workers.count=true", "workers.count"), ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("stop.time_s=-1", "stop.time_s"), ("checkpoint.keep=0", "checkpoint.keep"),
    ("faults.kills=[{slot: x1, step: 1}]", "faults.kills[0].slot"), ("eval_every=-1", "eval_every"),
    ("faults.scale=[{step: 5, count: 99}]", "faults.scale[0].count"), ("faults.scale=[{step: 0, count: 1}]", "faults.scale[0].step"),
    ("faults.server=[{version: 0}]", "faults.server[0].version"), ("faults.server=[{version: 5}]", "faults.server"),
])
def test_errors_are_one_line_and_start_with_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        config_from_dict(MINIMAL, [override])
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{key}:"), text


def test_yaml_error_names_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nworkload:\n  factory: [unclosed\nstop: {max_steps: 1}\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+"):
        load_config(path)


def test_run_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_from_dict(MINIMAL, ["run_dir=rel/runs"]).run_dir == str(tmp_path / "rel" / "runs")


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimizerConfig(name="adamw", lr=1.0, warmup_steps=4, schedule="cosine", min_lr=0.1)
    assert [lr_at(s, cfg, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 20) == pytest.approx(1.0)
    assert lr_at(12, cfg, 20) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, cfg, 20) == pytest.approx(0.1)
    assert lr_at(7, OptimizerConfig(lr=0.3), None) == 0.3


@pytest.mark.parametrize("over,message", [
    ({"workers": {"gpus": 0.5}}, "comm.backend: NCCL needs whole GPUs"),
    ({"workers": {"gpus": 0.5}, "comm": {"backend": "nccl"}}, "comm.backend: NCCL needs whole GPUs"),
    ({"comm": {"backend": "nccl"}}, "comm.backend: nccl needs workers.gpus >= 1"),
    ({"sync": {"policy": "local_sgd", "h": 4, "bucket_mb": 1}}, "sync.bucket_mb: is not a knob of policy 'local_sgd'"),
    ({"sync": {"policy": "streaming_diloco", "h": 8, "fragments": 3}}, "sync.fragments: must divide h = 8"),
    ({"sync": {"policy": "diloco", "outer_momentum": 0}}, "sync.nesterov: needs outer_momentum > 0"),
    ({"sync": {"policy": "ssp", "s": -1}}, "sync.s: must be at least 0"),
    ({"sync": {"policy": "ssp", "s": 1.5}}, "sync.s: expected an integer"),
    ({"sync": {"policy": "asp", "s": 1}}, "sync.s: is not a knob of policy 'asp'"),
    ({"sync": {"policy": "quorum", "k": 0}}, "sync.k: must be at least 1"),
    ({"sync": {"policy": "quorum", "k": 3}}, "sync.k: must not exceed workers.max = 2"),
    ({"sync": {"policy": "quorum", "s": 1}}, "sync.s: is not a knob of policy 'quorum'"),
    ({"server": {"shards": 0}}, "server.shards: must be at least 1"),
    ({"server": {"snapshot_every": 0}}, "server.snapshot_every: must be at least 1"),
    ({"server": {"cpus": -1}}, "server.cpus: must not be negative"),
    ({"server": {"replicas": 2}}, "server.replicas: unknown key"),
])
def test_bad_gpu_and_policy_settings_name_the_key(over, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(dict(MINIMAL, **over))
    assert str(err.value).startswith(message), str(err.value)


def test_fractional_gpus_over_gloo_are_allowed():
    cfg = config_from_dict(dict(MINIMAL, workers={"gpus": 0.5}, comm={"backend": "gloo"}))
    assert cfg.workers.gpus == 0.5


@pytest.mark.parametrize("sync", [{"policy": "asp"}, {"policy": "ssp", "s": 0}, {"policy": "quorum", "k": 2}])
def test_server_policies_are_accepted_and_keep_the_global_batch(sync):
    assert config_from_dict(dict(MINIMAL, sync=sync)).sync.policy == sync["policy"]
    with pytest.raises(ConfigError) as err:
        config_from_dict(dict(MINIMAL, sync=sync, workers={"batch_mode": "keep_worker"}))
    assert str(err.value).startswith("workers.batch_mode: policy"), str(err.value)


def test_server_section_defaults():
    server = config_from_dict(MINIMAL).server
    assert (server.shards, server.cpus, server.snapshot_every) == (1, 1.0, 50)


def test_numbers_written_without_a_dot_are_numbers():
    """YAML 1.1 (safe_load) reads `1e-5` as a string; a float field takes it as the number it is."""
    cfg = config_from_dict(dict(MINIMAL, optimizer={"name": "adamw", "lr": "3e-4", "eps": "1e-5"}))
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.eps == 1e-5
    with pytest.raises(ConfigError, match="optimizer.eps: expected a number, got str 'tiny'"):
        config_from_dict(dict(MINIMAL, optimizer={"eps": "tiny"}))
