"""The test helpers' own races: a process that ends while a helper looks at it."""
from __future__ import annotations

import subprocess
import sys

import psutil

from actors.testing import running


def test_a_process_that_ends_between_two_looks_counts_as_gone(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # gone, and reaped
    assert running(proc.pid) is False
    # the window a clean-clone CI run hit: `pid_exists` still said yes, and the process was gone when
    # its status was read (the helper raised psutil.NoSuchProcess and failed the test)
    monkeypatch.setattr(psutil, "pid_exists", lambda pid: True)
    assert running(proc.pid) is False


def test_a_live_process_is_running():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert running(proc.pid) is True
    finally:
        proc.kill()
        proc.wait()
