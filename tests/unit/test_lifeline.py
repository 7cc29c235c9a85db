"""A process's lifeline (actors/lifeline.py): a robust mutex its process holds for life. The kernel
releases it, and wakes the watcher, as the process's exit begins, whatever ends it; a watcher never
wakes for a process that runs on, stops once it is no longer wanted, and cannot be pointed at another
process's memory by a reused pid. The kernel's mechanism, on real processes (Linux with glibc; elsewhere
there is no lifeline and the other detectors find a death). How soon it wakes, against the process's
sockets closing, is a figure of benchmarks/kill_floor.py."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from actors.lifeline import Lifeline, watch
from actors.lifeline import _libc as libc

pytestmark = pytest.mark.skipif(libc() is None, reason="no lifeline here (needs Linux, memfd and glibc's robust mutexes)")

REPO = Path(__file__).resolve().parents[2]
CHILD = f"""
import json, sys, time
sys.path.insert(0, {str(REPO)!r})
from actors.lifeline import Lifeline
held = bytearray(100 * 2**20)
for i in range(0, len(held), 4096):
    held[i] = 1
line = Lifeline.hold()
print(json.dumps(line.info()), flush=True)
if sys.argv[1] == "exit":
    sys.stdin.readline()
    sys.exit(0)
time.sleep(600)
"""


def child(how: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_the_watcher_wakes_when_the_process_ends_and_not_before(how):
    proc, info = child(how)
    ended = threading.Event()
    try:
        thread = watch(proc.pid, info, ended.set, wanted=lambda: True)
        assert thread is not None, "a process of this machine, with its lifeline: watched"
        assert not ended.wait(1.5), "the process runs: the watcher sleeps (through a wanted() wake)"
        if how == "kill":
            proc.kill()
        else:
            proc.stdin.write("\n")
            proc.stdin.flush()
        assert ended.wait(60), f"the process ended ({how}): the watcher woke"
        thread.join(60)
    finally:
        proc.kill()
        proc.wait()


def test_a_watcher_no_longer_wanted_stops_without_waking_and_a_wrong_token_is_not_watched():
    proc, info = child("kill")
    try:
        wanted = threading.Event()
        wanted.set()
        ended = threading.Event()
        thread = watch(proc.pid, info, ended.set, wanted=wanted.is_set)
        assert thread is not None
        wanted.clear()
        thread.join(60)
        assert not thread.is_alive() and not ended.is_set(), "stopped at its next wanted() wake, without a call"
        wrong = dict(info, token="00" * 16)
        assert watch(proc.pid, wrong, ended.set, wanted=lambda: True) is None, "another token: not this lifeline"
        assert watch(proc.pid, dict(info, fd=999), ended.set, wanted=lambda: True) is None, "no such descriptor"
        assert watch(proc.pid, {}, ended.set, wanted=lambda: True) is None, "none said"
    finally:
        proc.kill()
        proc.wait()
    assert watch(proc.pid, info, ended.set, wanted=lambda: True) is None, "reaped: nothing to watch"


def test_the_holder_keeps_its_mutex_while_the_process_runs():
    line = Lifeline.hold()
    assert line is not None
    ended = threading.Event()
    import os
    thread = watch(os.getpid(), line.info(), ended.set, wanted=lambda: time.sleep(0) is None and not ended.is_set())
    assert thread is not None
    assert not ended.wait(1.5), "held by this process's own holder thread: no wake"
