"""The Grafana board (dashboards/orchestrator.json) is dashboard JSON Grafana loads, and every metric
its panels query is one the job exports (actors/observe/metrics.py), under the name Prometheus sees. Its import
asks for the data source; per-slot series are drawn as the top few, never one line per member."""
from __future__ import annotations

import json
import re
from pathlib import Path

from actors.observe.metrics import METRICS

BOARD = Path(__file__).resolve().parents[2] / "dashboards" / "orchestrator.json"
PANEL_TYPES = ("timeseries", "stat", "heatmap")


def exported_names() -> set[str]:
    names = set()
    for m in METRICS.values():
        base = m.exported
        names |= {base + suffix for suffix in ("_bucket", "_count", "_sum")} if m.kind == "histogram" else {base}
    return names


def test_the_board_is_dashboard_json_and_queries_only_exported_metrics():
    board = json.loads(BOARD.read_text())
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource", "job", "run"}
    ids, queried = set(), set()
    for panel in board["panels"]:
        assert panel["id"] not in ids and panel["type"] in PANEL_TYPES and panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bray_orchestrator_[a-z_]+", target["expr"]))
            assert names, target["expr"]
            assert '$job' in target["expr"] and '$run' in target["expr"], target["expr"]
            queried |= names
    unknown = queried - exported_names()
    assert not unknown, f"panels query metrics nobody exports: {sorted(unknown)}"
    unused = {m.exported for m in METRICS.values()} - {re.sub(r"_(bucket|count|sum)$", "", q) for q in queried}
    assert not unused, f"exported but on no panel: {sorted(unused)}"


def test_the_import_asks_for_the_prometheus_data_source():
    """Grafana's Import dialog asks for a data source only for the board's `__inputs`; the `datasource`
    variable starts at the one picked there (a board provisioned from a file falls back to the default)."""
    board = json.loads(BOARD.read_text())
    inputs = board.get("__inputs")
    assert inputs and [(i["type"], i["pluginId"]) for i in inputs] == [("datasource", "prometheus")], inputs
    variable = next(v for v in board["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == f"${{{inputs[0]['name']}}}"
    assert {"type": "datasource", "id": "prometheus"}.items() <= next(
        r for r in board["__requires"] if r["type"] == "datasource").items()


def test_per_slot_series_are_drawn_as_the_top_few():
    per_slot = {m.exported for m in METRICS.values() if "slot" in m.tags}
    assert per_slot
    for panel in json.loads(BOARD.read_text())["panels"]:
        for target in panel["targets"]:
            if any(name in target["expr"] for name in per_slot):
                assert target["expr"].startswith("topk("), target["expr"]
