"""The Ctrl-C of `python -m orchestrator run`: a SIGINT stops the owned job gracefully (exit 130) even
when it lands while the main thread runs a callback that swallows exceptions, as Ray's core worker does
with Python callbacks it runs on the main thread inside `ray.get` ("Exception ignored in ...")."""
from __future__ import annotations

import signal

import pytest

from core.schema import JobResult, JobStatus
from orchestrator.cli import EXIT_INTERRUPTED, EXIT_OK, CtrlC, ProgressPrinter, follow

RUN_DIR = "/runs/j/r"
CHECKPOINT = {"step": 4, "time": 1.0, "path": f"{RUN_DIR}/checkpoints/step-00000004-1a2b.pt"}


def _status(step: int, state: str = "RUNNING") -> JobStatus:
    ended = state in ("STOPPED", "FINISHED")  # the job's end wrote its final model and a checkpoint
    return JobStatus(name="j", run_id="r", state=state, step=step, membership_epoch=1, world_size=2, members=(),
                     loss=None, throughput=None, cause=None, run_dir=RUN_DIR, checkpoint=CHECKPOINT if ended else {})


def _swallowing_callback() -> None:
    """What a C extension's callback does with an exception it cannot pass on: prints and drops it."""
    try:
        signal.raise_signal(signal.SIGINT)  # to this thread; the handler has run when this returns
    except BaseException:  # noqa: BLE001 - the point: an interrupt raised here is lost
        pass


class FakeJob:
    """`wait` polls like ElasticJob.wait; at step 3 the SIGINT lands inside a swallowing callback; the job
    would finish at step 10 on its own."""

    def __init__(self, interrupt_at: int | None) -> None:
        self.interrupt_at = interrupt_at
        self.stopped_with: str | None = None

    def wait(self, on_status) -> JobResult:
        for step in range(1, 11):
            if step == self.interrupt_at:
                _swallowing_callback()
            state = "FINISHED" if step == 10 else "RUNNING"
            on_status(_status(step, state))
        return JobResult(name="j", run_id="r", state="FINISHED", step=10, cause=None, metrics={},
                         run_dir=RUN_DIR, elapsed_s=1.0)

    def stop(self, reason: str) -> JobStatus:
        self.stopped_with = reason
        return _status(4, "STOPPED")

    def status(self) -> JobStatus:
        return _status(10, "FINISHED")

    def model_location(self) -> str | None:
        return f"{RUN_DIR}/model.pt" if self.stopped_with or self.interrupt_at is None else None


def test_a_ctrl_c_swallowed_by_a_callback_still_stops_the_job_gracefully(capsys):
    job = FakeJob(interrupt_at=3)
    with CtrlC() as interrupt:
        code = follow(job, ProgressPrinter(10, 0.0), interrupt)
    assert (code, job.stopped_with) == (EXIT_INTERRUPTED, "interrupted (Ctrl-C)")
    assert "interrupted: stopping the job gracefully" in capsys.readouterr().out


@pytest.mark.parametrize("interrupt_at", [3, None])
def test_the_summary_says_where_the_final_model_and_the_last_checkpoint_are_also_after_a_ctrl_c(capsys, interrupt_at):
    job = FakeJob(interrupt_at=interrupt_at)
    with CtrlC() as interrupt:
        follow(job, ProgressPrinter(10, 0.0), interrupt)
    out = capsys.readouterr().out
    state, step = ("STOPPED", 4) if interrupt_at else ("FINISHED", 10)
    assert f"{state}: j run r at step {step}" in out
    assert f"  final model: {RUN_DIR}/model.pt (orchestrator.load_model('{RUN_DIR}') rebuilds it)" in out
    assert f"  last checkpoint: {CHECKPOINT['path']} (step 4; --resume continues from it)" in out
    assert f"  run dir: {RUN_DIR}" in out


def test_without_a_ctrl_c_the_job_runs_to_its_end():
    job = FakeJob(interrupt_at=None)
    with CtrlC() as interrupt:
        assert follow(job, ProgressPrinter(10, 0.0), interrupt) == EXIT_OK
    assert job.stopped_with is None


def test_a_second_ctrl_c_leaves_at_once_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), CtrlC():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
