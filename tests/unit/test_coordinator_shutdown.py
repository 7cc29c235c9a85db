"""The coordinator's shutdown ends: no task it started outlives it, on a stop or on a cancellation.

The real `Coordinator` runs over `FakeWorkerGroup` (testkit/fake_workers.py) on the test's event loop,
busy as a job is: members training and heartbeats going out (one to a hung member still waiting for
its answer), a death's reshape pending with the replacement held until the survivors commit, and a
driver's long poll (`watch_feed`) in flight. Then it is stopped and released, or every task on the
loop is cancelled as `asyncio.run` does at its end. Its tasks must be gone within a second (the bound is
the mechanism of actors/control/tasks.py), and no thread it started must still be busy.
"""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from actors.control.coordinator import Coordinator
from algorithms.rules.supervision import JobState, MemberState
from orchestrator.config import config_from_dict
from testkit.fake_workers import FakeWorkerGroup
from testkit.job_checks import until

BOUND_S = 1.0


def config() -> dict:
    return config_from_dict({
        "name": "shutdown", "seed": 0,
        "workers": {"count": 4, "min": 2, "cpus": 0.5, "heartbeat_s": 2.0, "start_grace_s": 0.2, "pause_after_s": 0.2,
                    "spares": 1},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8}, "batch_size": 8},
        "stop": {"max_steps": 1_000_000}, "eval_every": 0}).to_dict()


def others() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]


def named(tasks: Any) -> list[str]:
    return sorted(t.get_coro().__qualname__ for t in tasks)


async def busy(run_dir: Path) -> tuple[Coordinator, FakeWorkerGroup, asyncio.Future]:
    """A running job with its background tasks at work, and a driver's long poll in flight."""
    group = FakeWorkerGroup()
    coord = Coordinator(config(), "r1", str(run_dir), group=group)
    await coord.start()
    await until(lambda: coord.job.state == JobState.RUNNING and coord.spares.ready(), "RUNNING, with a ready spare")
    await group.commit(coord, 3)
    group.hang("w3")  # its heartbeat is never answered: the call waits for its timeout
    await until(lambda: (t := coord.book.members["w3"].beat_task) is not None and not t.done()
                and group.current("w3").hung, "a heartbeat to the hung member in flight")
    group.die("w1")
    await until(lambda: coord.book.plan.members == ("w0", "w2", "w3") and coord.book.pending
                and coord.book.members["w1"].state == MemberState.STARTING,
                "the survivors' plan, its reshape pending, w1's replacement held")
    poll = asyncio.ensure_future(coord.watch_feed(coord.journal.count + 10_000, 10**9, 30.0))
    await asyncio.sleep(0)  # the long poll waits on the feed
    assert not poll.done()
    return coord, group, poll


async def no_busy_thread(before: set[threading.Thread]) -> None:
    """The loop's thread pool shuts down at once (no call the coordinator made in a thread is still
    running), and no other thread that is not a daemon was left behind."""
    started = time.monotonic()
    await asyncio.get_running_loop().shutdown_default_executor()
    assert time.monotonic() - started < BOUND_S, "a call the coordinator made in a thread was still running"
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert not left, f"threads left running: {left}"


def test_every_task_of_a_busy_coordinator_ends_within_a_second_of_its_cancellation(tmp_path):
    """What `asyncio.run` does when its main coroutine returns or raises (the control-plane benchmark's
    memory phase): cancel every task left, and wait for them. The coordinator's main task, cancelled,
    neither draws the report nor lingers for a driver's release (it once lingered 600 s there)."""
    async def scenario():
        threads = set(threading.enumerate())
        coord, _, poll = await busy(tmp_path)
        tasks = others()
        assert coord.lifecycle.main_task in tasks and poll in tasks
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=BOUND_S)
        assert not pending, f"still running {BOUND_S:g} s after their cancellation: {named(pending)}"
        assert not others(), f"tasks started while the others were being cancelled: {named(others())}"
        await no_busy_thread(threads)
        coord.journal.close()
    asyncio.run(scenario())


def test_a_stopped_and_released_coordinator_leaves_no_task_behind(tmp_path):
    """The ordinary end: a stop while a reshape is pending, the members finish, the driver reads the end
    and releases the coordinator. Its main task ends and takes every task it started with it (the forced
    stop's timer, the heartbeats, the unanswered one to the hung member, the replacement's hold); the
    long poll was answered with the end."""
    async def scenario():
        threads = set(threading.enumerate())
        coord, group, poll = await busy(tmp_path)
        await coord.request_stop()
        await group.commit(coord, 3)
        await until(lambda: coord.job.state.terminal, "the stop")
        assert coord.job.state == JobState.STOPPED
        await coord.release()
        await asyncio.wait_for(coord.lifecycle.main_task, 10)
        assert poll.done() and poll.result()["state"] == "STOPPED", "the long poll is answered with the end"
        assert not others(), f"left after the coordinator ended: {named(others())}"
        await no_busy_thread(threads)
    asyncio.run(scenario())
