"""The environment an NCCL group is formed in: NCCL's sockets on the interface that owns the node's address,
unless the user named one, a loopback address left to NCCL (actors/transport/nccl.py `_nccl_environment`); the
driver's own `NCCL_*` and `TORCH_NCCL_*` settings passed to an NCCL job's coordinator, whose workers inherit
them (orchestrator/coordinator_handle.py `nccl_environment`). Pure: no GPU is needed to decide either."""
from __future__ import annotations

import os

from actors.transport.nccl import _nccl_environment, interface_of

HOST = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5", "fe80::1"], "ib0": ["192.168.7.5"], "docker0": ["172.17.0.1"]}


def test_the_interface_that_owns_the_nodes_address_is_named():
    assert interface_of("10.0.0.5", HOST) == "eth0"
    assert interface_of("192.168.7.5", HOST) == "ib0"
    assert interface_of("fe80::1", HOST) == "eth0"
    assert interface_of("10.9.9.9", HOST) is None  # nobody's: NCCL chooses
    assert interface_of("127.0.0.1", HOST) is None  # one node on loopback: NCCL's own choice works


def test_the_users_setting_stands_and_otherwise_this_hosts_interface_is_set_exactly(monkeypatch):
    for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"), ("TORCH_NCCL_NONBLOCKING_TIMEOUT", "10")):
        monkeypatch.setenv(name, value)  # restored after the test, as everything set here
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")
    _nccl_environment(10.0, "10.0.0.5")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    monkeypatch.setattr("actors.transport.nccl.interface_of", lambda address: {"10.0.0.5": "eth0"}.get(address))
    _nccl_environment(10.0, "10.0.0.5")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=eth0"  # exactly eth0, not every interface whose name it prefixes
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    _nccl_environment(10.0, "127.0.0.1")
    assert "NCCL_SOCKET_IFNAME" not in os.environ


def test_the_drivers_nccl_settings_go_to_an_nccl_jobs_coordinator_and_workers_and_nothing_else():
    from orchestrator.config import config_from_dict
    from orchestrator.coordinator_handle import nccl_environment

    base = {"name": "env", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 1}}
    environ = {"NCCL_IB_HCA": "mlx5", "TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_DEBUG": "WARN", "HOME": "/root",
               "AWS_SECRET_ACCESS_KEY": "never", "MY_NCCL_NOTE": "x"}
    on_gpus = config_from_dict({**base, "workers": {"count": 2, "gpus": 1}})
    assert nccl_environment(on_gpus, environ) == {"NCCL_IB_HCA": "mlx5", "TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_DEBUG": "WARN"}
    assert nccl_environment(config_from_dict(base), environ) == {}  # gloo: nothing to pass
    over_gloo = config_from_dict({**base, "workers": {"count": 2, "gpus": 1}, "comm": {"backend": "gloo"}})
    assert nccl_environment(over_gloo, environ) == {}


def test_a_users_blocking_wait_is_turned_off_with_a_warning_and_zero_stands(monkeypatch, caplog):
    """`TORCH_NCCL_BLOCKING_WAIT=1` would make the launch's `work.wait()` block the host inside the
    backward hooks (no overlap, and no abort can release the launching thread)."""
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with caplog.at_level("WARNING", logger="actors.transport.nccl"):
        _nccl_environment(10.0, "127.0.0.1")
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert "TORCH_NCCL_BLOCKING_WAIT=1 ignored" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    _nccl_environment(10.0, "127.0.0.1")
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "0" and not caplog.text
