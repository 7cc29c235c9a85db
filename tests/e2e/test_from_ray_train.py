"""docs/from-ray-train.md runs as written: its files are taken from the page (each code block whose first
line is `# <file name>`), written into an empty folder and run with the page's own command; the project's
side on this session's Ray, the Ray Train side (where ray[train] is installed) as `python <file>`."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from testkit.harness import child_env

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "from-ray-train.md"


def page_files() -> dict[str, str]:
    """Every code block of the page whose first line names a file (`# my_mlp.py`), by that name."""
    blocks = re.findall(r"^```\w+\n(# (\S+)\n.*?)^```$", PAGE.read_text(), re.M | re.S)
    return {name: text for text, name in blocks}


def page_commands() -> list[list[str]]:
    """The page's shell commands (its `bash` blocks), each as its words."""
    return [line.split() for block in re.findall(r"^```bash\n(.*?)^```$", PAGE.read_text(), re.M | re.S)
            for line in block.splitlines() if line.strip()]


def written(tmp_path: Path, *names: str) -> Path:
    files = page_files()
    folder = tmp_path / "project"
    folder.mkdir()
    for name in names:
        (folder / name).write_text(files[name])
    return folder


def test_the_page_holds_both_sides_and_the_command_that_runs_this_one():
    assert {"ray_train_mlp.py", "my_mlp.py", "mlp.yaml"} <= set(page_files())
    assert ["python", "-m", "orchestrator", "run", "mlp.yaml"] in page_commands()


def test_the_projects_side_runs_as_written(tmp_path, ray_session):
    """The factory module and the YAML as the page has them, run with its command from their folder
    (attached to this session's Ray with --address, as the page says a run on a Ray cluster is)."""
    folder = written(tmp_path, "my_mlp.py", "mlp.yaml")
    env = child_env(REPO, ORCHESTRATOR_RUN_ROOT=str(tmp_path / "runs"))
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", "mlp.yaml", "--address", address], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=280)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^FINISHED: digits-mlp run \S+ at step 113 ", proc.stdout, re.M), proc.stdout[-1000:]
    assert float(re.search(r"accuracy: ([\d.]+)", proc.stdout).group(1)) > 0.9


@pytest.mark.slow  # about 35 s of Ray Train on 2 cores for a page's other side: run with --run-slow
def test_the_ray_train_side_runs_as_written(tmp_path, ray_session):
    """The Ray Train script as the page has it (`python ray_train_mlp.py`), on this session's Ray
    (RAY_ADDRESS, and its token) with its results under a home of its own (Ray Train writes to
    ~/ray_results)."""
    pytest.importorskip("ray.train.torch", reason="ray[train] is not installed (pip install -e '.[bench]')")
    folder = written(tmp_path, "ray_train_mlp.py")
    env = child_env(REPO, HOME=str(tmp_path), RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    token = Path.home() / ".ray" / "auth_token"  # the session's Ray's token, where its own home keeps it
    if token.exists():
        env.setdefault("RAY_AUTH_TOKEN_PATH", str(token))
    proc = subprocess.run([sys.executable, "ray_train_mlp.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=280)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'epoch': 4" in proc.stdout and str(tmp_path / "ray_results" / "digits-mlp") in proc.stdout
