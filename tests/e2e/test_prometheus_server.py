"""A real Prometheus server (Debian's `prometheus` package) scrapes the local Ray node's metrics endpoint
during a job and answers a query for one of the job's metrics through its HTTP API, and every query of
the Grafana board (dashboards/orchestrator.json) with its variables filled in (slow)."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import ray

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import free_port, wait_until

PROMETHEUS = shutil.which("prometheus")
BOARD = Path(__file__).resolve().parents[2] / "dashboards" / "orchestrator.json"


def query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    answer = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="needs a prometheus binary (apt install prometheus)")
def test_a_prometheus_server_scrapes_the_job_s_metrics_and_answers_a_query(tmp_path, run_root):
    node = next(n for n in ray.nodes() if n["Alive"])
    target = f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ray\n"
        f"    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    server = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        cfg = {"name": "prom", "workers": {"count": 2, "cpus": 0.5},
               "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8}, "eval_every": 0,
               "stop": {"max_steps": 1_000_000}, "faults": {"stragglers": [{"slot": "w0", "delay_s": 0.02}]}}
        job = ElasticJob(config_from_dict(cfg)).start()
        run = wait_until(lambda: (s := job.status()).step > 20 and s.run_id, what="training")
        expr = f'sum(ray_orchestrator_committed_steps_total{{job_name="prom", run="{run}"}})'
        found = wait_until(lambda: query(port, expr), timeout=60, what="the metric in Prometheus", every=1.0)
        steps = float(found[0]["value"][1])
        status = job.status()
        print(f"Prometheus at 127.0.0.1:{port} scraping {target}: {expr} = {steps} (status step {status.step})")
        assert 0 < steps <= status.step
        world = query(port, f'max(ray_orchestrator_world_size{{run="{run}"}})')
        assert float(world[0]["value"][1]) == 2
        since = query(port, f'time() - max(ray_orchestrator_last_commit_timestamp_seconds{{run="{run}"}})')
        assert 0 <= float(since[0]["value"][1]) < 60, since
        for panel in json.loads(BOARD.read_text())["panels"]:  # each parses and runs (an error answers status "error")
            for target in panel["targets"]:
                query(port, target["expr"].replace("$job", "prom").replace("$run", run).replace("$__range", "5m"))
        job.stop()
    finally:
        server.terminate()
        server.wait(timeout=30)
