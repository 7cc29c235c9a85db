"""The coordinator's probe of a worker tells a dead actor from a silent one, so that an eviction
after a failed collective names the right detector (the death, when that is what the probe met)."""
from __future__ import annotations

import asyncio
import os
import signal

import ray

from actors.control.workers import probe_actor
from testkit.harness import CommPeer


def test_a_probe_tells_a_dead_worker_from_a_silent_one_and_a_live_one(ray_session):
    dead, frozen, alive = peers = [CommPeer.remote() for _ in range(3)]
    pids = ray.get([p.pid.remote() for p in peers], timeout=60)
    os.kill(pids[0], signal.SIGKILL)
    os.kill(pids[1], signal.SIGSTOP)

    async def ask_all():
        return await asyncio.gather(*(probe_actor("pid", lambda p=p: p.pid.remote(), timeout=1.0) for p in peers))
    try:
        (d, d_why), (f, f_why), (a, a_why) = asyncio.run(ask_all())
    finally:
        os.kill(pids[1], signal.SIGCONT)
        for p in peers:
            ray.kill(p)
    assert d is None and d_why, "Ray says the SIGKILLed actor died, within the probe's second"
    assert (f, f_why) == (None, None), "a stopped process does not answer: silent, not dead"
    assert (a, a_why) == (pids[2], None)
