"""How a job shows in a notebook (core/display.py, orchestrator/notebook.py): compact HTML from a
status, and `watch` that follows a job to its end, blocking or from a background thread."""
from __future__ import annotations

import threading
import time

from core.schema import Event, JobStatus, MemberStatus
from orchestrator import notebook


def status(state: str = "RUNNING", step: int = 40) -> JobStatus:
    return JobStatus(name="digits<bsp>", run_id="r1", state=state, step=step, membership_epoch=3, world_size=2,
                     members=(MemberStatus("w0", 0, "10.0.0.1", 11, "training"),
                              MemberStatus("w1", 1, "10.0.0.2", 12, "training"),
                              MemberStatus("w2", -1, "10.0.0.3", 13, "dead", cause="SIGKILL")),
                     loss=0.25, throughput=12.5, cause=None, run_dir="/runs/x", metrics={"accuracy": 0.93},
                     stragglers={"w1": 3.1}, reshapes=(Event(1.0, "reshape", "w2 died"),))


def test_a_status_shows_its_state_step_members_and_stragglers_escaped():
    html = status()._repr_html_()
    assert "digits&lt;bsp&gt;" in html and "<bsp>" not in html, "names are escaped"
    assert "RUNNING" in html and "step 40" in html and "world 2" in html and "epoch 3" in html
    assert "loss 0.2500" in html and "12.5 steps/s" in html and "accuracy 0.9300" in html
    rows = html.split("<tr>")[2:]
    assert len(rows) == 3 and "w1" in rows[1] and "3.10" in rows[1], "w1's step time over the median"
    assert ">-<" in rows[2], "a departed member has no rank"
    bar = notebook.status_html(status(step=30), (), max_steps=120)
    assert "step 30/120" in bar and "width:25.0%" in bar


def test_watch_follows_the_job_to_its_end_in_the_background(capsys):
    states = iter(["STARTING", "RUNNING", "RUNNING", "FINISHED"])
    reads = []

    def read():
        s = status(next(states), step=len(reads) * 10)
        reads.append(s.state)
        return s, ()
    began = time.monotonic()
    thread = notebook.watch(read, 30, timeout=None, every=0.05, block=False)
    # it returns at once (microseconds); the bound is 5 s, the reads take 0.15 s
    assert isinstance(thread, threading.Thread) and time.monotonic() - began < 5.0, "returns at once"
    thread.join(5)
    assert not thread.is_alive() and reads == ["STARTING", "RUNNING", "RUNNING", "FINISHED"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "digits<bsp> FINISHED step 30/30 world 2 loss 0.2500"


def test_watch_returns_after_its_timeout_while_the_job_goes_on():
    began = time.monotonic()
    assert notebook.watch(lambda: (status(), ()), None, timeout=0.3, every=0.05, block=True) is None
    assert 0.3 <= time.monotonic() - began < 10.0  # after its timeout (the job, a fake, never ends)
