"""Shared fixtures: one local Ray per test session (start-up costs ~6 s), and the slow marker."""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("ORCHESTRATOR_REPORT", "0")  # no run report per job (tests that want one ask in their config)
# the local runs the tests start record their Ray's address here, not in the user's ~/.orchestrator
os.environ.setdefault("ORCHESTRATOR_LOCAL_RUNS", tempfile.mkdtemp(prefix="orchestrator-local-runs-"))
# the S3 tests' server (moto, on 127.0.0.1) takes any key; set before Ray starts, so that every actor has
# them, and no SDK looks for an instance role on a network this machine cannot reach
for _name, _value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                      ("AWS_EC2_METADATA_DISABLED", "true")):
    os.environ.setdefault(_name, _value)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(autouse=True)
def _end_local_jobs():
    """After each test, end the in-process replicas it left running (`testkit.in_process.LocalJob.close`):
    a test that failed before its stop would leave them training in their threads, reseeding this
    process's random generator at every step, and every later test here would draw other initial
    models (CI AL: ten oracles failed in one xdist worker after one such test)."""
    yield
    module = sys.modules.get("testkit.in_process")  # not imported: no LocalJob was made
    if module is not None:
        left = module.close_started()
        if left:
            warnings.warn(f"replicas left running by the test were ended: {', '.join(left)}", stacklevel=1)


SOURCES = ("core", "actors", "algorithms", "orchestrator", "testkit", "tests/workloads")
"""The project's packages that processes the tests start import (workers, coordinators, the CLI)."""


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's sources to bytecode once, before any test starts a process. Where
    `PYTHONDONTWRITEBYTECODE` is set (as on this machine), no import writes it, so on a clean clone each of
    the suite's several hundred processes (Ray workers, coordinators, CLI runs) compiled every module it
    imported anew: about 0.35 CPU-s each. Reading bytecode is not switched off by that setting. Under
    pytest-xdist the controller compiles, before its workers start."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    for folder in SOURCES:
        compileall.compile_dir(str(REPO / folder), quiet=1, workers=1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (benchmarks, soak, chaos)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the tests marked `exclusive` last, in their order: under pytest-xdist they then run in one or two
    # blocks, each waiting once for the other process's test in flight (see `_machine_share`); spread
    # through the suite, each of them waited for one (142 s of waits in all, and 57 s more for the
    # shared tests behind them, in a run of the default suite here)
    items[:] = [i for i in items if not _exclusive(i)] + [i for i in items if _exclusive(i)]
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _exclusive(item: pytest.Item) -> bool:
    return item.get_closest_marker("exclusive") is not None


_held: list = []
"""The lock file, while this process holds the machine from one exclusive test to the next."""


@contextlib.contextmanager
def _machine_share(exclusive: bool, next_exclusive: bool):
    """Under pytest-xdist the suite runs in two processes that share this machine's two cores. A test
    marked `exclusive` (it measures a time, a rate or a ratio, or it changes what the whole machine
    shares, such as the loopback's queueing) runs alone: it waits until the other process's test
    ends, and no other test starts until it is done; when the next test of this process is exclusive
    too, the machine stays held for it. The others run side by side. One lock file per run (its
    xdist run id) with a turnstile, so that a waiting exclusive test is not starved by the other
    process's stream of shared holders."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one process: nothing to share
        yield
        return
    if exclusive and _held:
        lock = _held.pop()  # the test before held it for this one
    else:
        base = Path(tempfile.gettempdir()) / f"orchestrator-tests-{run}"
        lock = open(f"{base}.lock", "a+")
        with open(f"{base}.turnstile", "a+") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    try:
        yield
    finally:
        if exclusive and next_exclusive:
            _held.append(lock)
        else:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Setup, call and teardown of each test hold the machine's share (see `_machine_share`)."""
    with _machine_share(_exclusive(item), nextitem is not None and _exclusive(nextitem)):
        return (yield)


def _ensure_ray():
    import ray

    from orchestrator.job import NAMESPACE, ensure_token_env

    if not ray.is_initialized():
        ensure_token_env()
        ray.init(address="local", num_cpus=8, namespace=NAMESPACE, log_to_driver=False, include_dashboard=False, logging_level="ERROR",
                 _system_config={"metrics_report_interval_ms": 1000})  # metrics reach the node's endpoint within 1 s
        # Ray's log monitor tails every worker's log files for drivers that print them (log_to_driver is
        # off here): it polls a session directory that grows by a few files per actor, and took 42 and
        # 28 CPU-s of the two sessions in a suite run here (4% of a core by the end), for nothing
        ray._private.worker._global_node.kill_log_monitor()
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


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request: pytest.FixtureRequest):
    """Every job a Ray test started in this process and left running (an assertion failed before its own
    stop) is stopped when the test ends: one failure must not leave a job training beside the tests
    after it, where it would slow them down and skew what they measure."""
    if not {"run_root", "ray_session"} & set(request.fixturenames):
        yield
        return
    from orchestrator.job import ElasticJob

    started: list = []
    start = ElasticJob.start

    def recorded_start(self, *args, **kwargs):
        started.append(self)
        return start(self, *args, **kwargs)
    ElasticJob.start = recorded_start
    try:
        yield
    finally:
        ElasticJob.start = start
        for job in started:
            _stop_if_running(job)


def _stop_if_running(job) -> None:
    from core.schema import TERMINAL_STATES

    if job._coordinator is None:  # waited for or stopped: its actors are gone
        return
    try:
        if job.status().state not in TERMINAL_STATES:
            job.stop(reason="the test that started it ended", timeout=60)
        else:
            job._release()
    except Exception as err:  # noqa: BLE001 - the test's own outcome stands; say why the job may linger
        print(f"could not stop job {job.name!r} after its test: {type(err).__name__}: {err}")


@pytest.fixture
def run_root(ray_session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh run-directory root per test (jobs write under it)."""
    monkeypatch.setenv("ORCHESTRATOR_RUN_ROOT", str(tmp_path))
    _ensure_ray()
    return tmp_path
