"""What an event says when a worker's constructor raised (actors/control/members.py `describe`): the user's own
exception (type and message), not Ray's "The actor died because of an error raised in its creation
task" header, which is all its first line holds."""
from __future__ import annotations

import traceback

import ray.exceptions

from actors.control.members import describe


def test_a_constructor_that_raised_is_described_by_its_exception():
    def build_workload():
        raise ValueError("the workload cannot be built: no such column 'label'\nsecond line of the message")
    try:
        build_workload()
    except ValueError as err:
        task_error = ray.exceptions.RayTaskError("WorkerActor.__init__", traceback.format_exc(), err,
                                                 proctitle="ray::WorkerActor.__init__()", pid=12, ip="127.0.0.1")
    died = ray.exceptions.ActorDiedError(task_error)
    assert describe(died) == "its constructor raised ValueError: the workload cannot be built: no such column 'label'"


def test_other_errors_keep_their_first_line():
    assert describe(RuntimeError("boom\nmore")) == "boom"
    assert describe(ray.exceptions.ActorDiedError()).startswith("The actor died unexpectedly")
