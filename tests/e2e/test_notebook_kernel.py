"""A real Jupyter kernel (nbclient) runs a notebook that starts a job, shows it as HTML, watches it to
the end and shows the result (slow: the kernel starts its own local Ray)."""
from __future__ import annotations

from pathlib import Path

import pytest

from testkit.harness import child_env

nbformat = pytest.importorskip("nbformat", reason="needs nbformat, nbclient and ipykernel")
nbclient = pytest.importorskip("nbclient", reason="needs nbformat, nbclient and ipykernel")
pytest.importorskip("ipykernel", reason="needs nbformat, nbclient and ipykernel")

REPO = Path(__file__).resolve().parents[2]
CELLS = [
    "import os\nos.environ['ORCHESTRATOR_RUN_ROOT'] = RUN_ROOT\n"
    "from orchestrator.config import config_from_dict\nfrom orchestrator.job import ElasticJob",
    "job = ElasticJob(config_from_dict({'name': 'notebook', 'workers': {'count': 2, 'cpus': 0.5},\n"
    "    'workload': {'factory': 'orchestrator.workloads.digits:mlp', 'batch_size': 16},\n"
    "    'stop': {'max_steps': 150}, 'eval_every': 50, 'tracking': {'report': True}})).start()\njob",
    "job.watch(timeout=180, every=0.5)",
    "result = job.wait(timeout=60)\nprint(result.state, result.step)\njob.status()",
]


@pytest.mark.slow
def test_a_notebook_starts_shows_watches_and_shows_the_result_of_a_job(tmp_path, monkeypatch):
    for key, value in child_env(REPO).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"RUN_ROOT = {str(tmp_path)!r}")] + [nbformat.v4.new_code_cell(c) for c in CELLS]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [cell.outputs for cell in nb.cells]
    shown = outputs[2][0]["data"]["text/html"]
    assert "notebook" in shown and "step" in shown, shown
    watched = [o for o in outputs[3] if o.get("output_type") in ("display_data", "update_display_data")]
    assert watched and "text/html" in watched[0]["data"], outputs[3]
    final_html = outputs[4][-1]["data"]["text/html"]
    stdout = "".join(o.get("text", "") for o in outputs[4] if o.get("output_type") == "stream")
    print(stdout, final_html[:300])
    assert stdout.startswith("FINISHED 150") and "FINISHED" in final_html and "accuracy" in final_html
    assert list(tmp_path.glob("notebook/*/report.png")), "the job's end drew the run report"
