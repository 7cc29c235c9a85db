"""A restarted coordinator's call to its own `start` (actors/control/workers.py: `start_self_when_alive`).

Ray refuses a call an actor sends itself while it is still RESTARTING ("the actor is restarting")
and does not retry it; a coordinator whose `start` was refused never ran, and its job hung. These
tests stand in for Ray's refusals with the exception Ray raises."""
from __future__ import annotations

import threading

from ray.exceptions import ActorUnavailableError

from actors.control.workers import start_self_when_alive


def refused_then_taken(refusals: int):
    calls: list[int] = []

    def call() -> None:
        calls.append(1)
        if len(calls) <= refusals:
            raise ActorUnavailableError("The actor is temporarily unavailable: IOError: The actor is restarting.", None)

    return calls, call


def test_a_refused_start_is_asked_again_until_taken():
    calls, call = refused_then_taken(3)
    gave_up = threading.Event()
    thread = start_self_when_alive("job", "ns", deadline_s=30, call=call, give_up=gave_up.set)
    thread.join(timeout=10)
    assert not thread.is_alive() and len(calls) == 4 and not gave_up.is_set()


def test_a_start_never_taken_gives_up_at_the_deadline():
    calls, call = refused_then_taken(10**6)
    gave_up = threading.Event()
    thread = start_self_when_alive("job", "ns", deadline_s=0.5, call=call, give_up=gave_up.set)
    assert gave_up.wait(timeout=10) and len(calls) >= 2
    thread.join(timeout=5)
