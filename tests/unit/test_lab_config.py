"""The lab's pure side: `network:` parsing, slot placement, and the tc commands it would run."""
from __future__ import annotations

import pytest

from core.schema import ConfigError, NetworkConfig, parse
from orchestrator.config import config_from_dict
from orchestrator.lab import HANDLE, LabUnavailable, check_privileges, tc_commands

BASE = {"name": "lab", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "stop": {"max_steps": 5}}


def net(**over) -> NetworkConfig:
    return parse(NetworkConfig, {"nodes": 2, "workers_per_node": 2, **over}, "network")


def test_slots_fill_nodes_in_order_and_each_node_has_its_own_address():
    n = net(subnet="127.88.0.0/24")
    assert [n.node_of(f"w{i}") for i in range(6)] == [0, 0, 1, 1, 0, 0]
    assert [n.address(k) for k in range(2)] == ["127.88.0.1", "127.88.0.2"]


def test_links_default_and_per_pair():
    n = net(nodes=3, inter={"mbit": 100, "latency_ms": 2}, links=[{"a": 2, "b": 0, "mbit": 10}])
    assert n.link(0, 0) is n.intra and n.link(0, 0).mbit is None
    assert n.link(0, 1).mbit == 100 and n.link(1, 0).latency_ms == 2
    assert n.link(0, 2).mbit == 10 and n.link(2, 0).mbit == 10


def test_tc_commands_shape_only_the_lab_pairs_in_both_directions():
    cmds = tc_commands(net(inter={"mbit": 100}))
    assert cmds[0] == ["tc", "qdisc", "add", "dev", "lo", "root", "handle", f"{HANDLE}:", "htb", "default", "0"]
    acks = [c for c in cmds if f"{HANDLE}:ffff" in c]  # the acknowledgements' class and its filters
    assert acks[0][1] == "class" and [c[c.index("u16") + 1] for c in acks[1:]] == ["0x0028", "0x0034", "0x0040",
                                                                                  "0x0048", "0x0050"]
    assert all(c[c.index("prio") + 1] == "1" for c in acks[1:])
    classes = [c for c in cmds if c[1] == "class" and c not in acks]
    filters = [c for c in cmds if c[1] == "filter" and c not in acks]
    assert all(f[f.index("prio") + 1] == "2" for f in filters)  # after the acknowledgements' filters
    assert len(classes) == len(filters) == 2  # 0 -> 1 and 1 -> 0; intra-node unshaped: unclassified, direct
    assert all(c[c.index("rate") + 1] == "100000kbit" == c[c.index("ceil") + 1] for c in classes)
    pairs = {(f[f.index("src") + 1], f[f.index("dst") + 1]) for f in filters}
    assert pairs == {("127.77.0.1/32", "127.77.0.2/32"), ("127.77.0.2/32", "127.77.0.1/32")}
    shaped_intra = tc_commands(net(intra={"mbit": 1000}, inter={"mbit": 100}))
    assert len([c for c in shaped_intra if c[1] == "filter" and f"{HANDLE}:ffff" not in c]) == 4


@pytest.mark.parametrize("bad,key", [
    ({"subnet": "10.0.0.0/24"}, "network.subnet"),
    ({"subnet": "127.0.0.0/24"}, "network.subnet"),
    ({"links": [{"a": 0, "b": 5}]}, "network.links[0]"),
    ({"inter": {"mbit": 0}}, "network.inter.mbit"),
    ({"inter": {"latency_ms": -1}}, "network.inter.latency_ms"),
    ({"workers_per_node": 0}, "network.workers_per_node"),
])
def test_bad_network_is_named(bad, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict({**BASE, "network": {"nodes": 2, **bad}})


def test_server_policies_are_refused_in_the_lab_with_the_reason():
    with pytest.raises(ConfigError, match="object transport"):
        config_from_dict({**BASE, "sync": {"policy": "ssp"}, "network": {"nodes": 2}})


def test_without_root_the_lab_says_why(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(LabUnavailable, match="root"):
        check_privileges()
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(LabUnavailable, match="tc"):
        check_privileges()


def test_lab_command_exits_2_with_the_reason_where_it_cannot_shape(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main

    lab_file = tmp_path / "lab.yaml"
    lab_file.write_text("network:\n  nodes: 2\n  workers_per_node: 2\n  inter: {mbit: 100}\n")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["lab", "up", str(lab_file)]) == 2
    assert "needs root" in capsys.readouterr().err
    assert main(["lab", "up"]) == 2  # no config
    (tmp_path / "none.yaml").write_text("name: x\n")
    assert main(["lab", "up", str(tmp_path / "none.yaml")]) == 2
    assert "no network: section" in capsys.readouterr().err
