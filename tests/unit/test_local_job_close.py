"""The in-process harness ends replicas a test left running (`LocalJob.close`, called for every test by
tests/conftest.py). Left running, they train on in their threads and reseed the process's random
generator at every step, so the models that later tests in the process initialize from a seed differ
(measured: 94 of 8,295 initializations of the oracles' MLP, by up to 0.5, while four such replicas ran)."""
from __future__ import annotations

import threading

from testkit.harness import wait_until
from testkit.in_process import LocalJob
from tests.unit.test_policy_switch import BATCH, SLOTS, N, config


def test_close_ends_replicas_that_were_never_told_to_stop(tmp_path):
    job = LocalJob(config({"policy": "bsp"}), list(SLOTS), str(tmp_path))  # max_steps 1,000,000: no stop
    job.publish(SLOTS, 1, N * BATCH)
    job.start()
    wait_until(lambda: job.replicas["w0"].training.step >= 3, what="step 3")
    assert job.close() == list(SLOTS)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("replica ") and t.is_alive()]
    assert job.close() == []  # nothing left to end
