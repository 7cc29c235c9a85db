"""Shared fixtures: one local Ray per test session (start-up costs ~6 s), and the slow marker."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (benchmarks, soak, chaos)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _ensure_ray():
    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    if not ray.is_initialized():
        ensure_token_env()
        ray.init(num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False, logging_level="ERROR")
    return ray


@pytest.fixture(scope="session")
def _ray_owner(tmp_path_factory: pytest.TempPathFactory):
    """Shuts the shared local Ray down at the end of the session."""
    os.environ.setdefault("ORCHESTRATOR_RUN_ROOT", str(tmp_path_factory.mktemp("runs")))
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_session(_ray_owner):
    """A local Ray with 8 logical CPUs (more than the 2 cores: the workers are small), started once
    per session; re-started only if a test had to disconnect (to connect to a cluster of its own)."""
    return _ensure_ray()


@pytest.fixture
def run_root(ray_session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh run-directory root per test (jobs write under it)."""
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path))
    _ensure_ray()
    return tmp_path
