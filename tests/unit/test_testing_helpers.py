"""The test helpers' own races: a process that ends while a helper looks at it."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import psutil

from testkit.harness import QUIET_PORTS_FROM, free_port, running


def test_a_process_that_ends_between_two_looks_counts_as_gone(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # gone, and reaped
    assert running(proc.pid) is False
    # the window a clean-clone CI run hit: the process was there at the first look and gone when its
    # status was read (the helper raised psutil.NoSuchProcess and failed the test)

    class Vanishing:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def status(self) -> str:
            raise psutil.NoSuchProcess(self.pid)
    monkeypatch.setattr(psutil, "Process", Vanishing)
    assert running(12345) is False


def test_a_live_process_is_running():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert running(proc.pid) is True
    finally:
        proc.kill()
        proc.wait()


def test_a_free_port_is_one_the_kernel_never_hands_out_by_itself():
    """A server a test starts binds its port well after the pick (a head node's agents, seconds later):
    a port from the ephemeral range could be taken meanwhile by any bind(0) or outgoing connection of
    the tests beside it; one below that range and above Ray's worker ports cannot."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(50)}
    assert all(QUIET_PORTS_FROM <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # drawn at random: two processes rarely pick the same one
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free
    with socket.socket() as s:  # what bind(0) takes comes from the ephemeral range
        s.bind(("127.0.0.1", 0))
        assert low <= s.getsockname()[1] <= high
