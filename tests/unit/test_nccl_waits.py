"""How an NCCL group decides an operation failed, apart from the GPU it runs on (actors/transport/nccl.py):
NCCL's own recorded error (a communicator its watchdog aborted, a peer's remote error) fails the group
instead of a partial sum being read as a result; an operation's deadline counts from when the device
reached it, not from its launch on a host that runs ahead of the GPU. The GPU tier runs the rest."""
from __future__ import annotations

import enum

from actors.transport.nccl import DeviceDeadline, nccl_fault


class ErrorType(enum.Enum):  # the shape of torch's c10d ErrorType
    SUCCESS = 0
    TIMEOUT = 1
    COMM_ERROR = 2
    REMOTE_ERROR = 3


class Backend:
    def __init__(self, error=ErrorType.SUCCESS, raises: Exception | None = None) -> None:
        self.error, self.raises = error, raises

    def get_error(self):
        if self.raises is not None:
            raise self.raises
        return self.error


def test_nccls_own_errors_are_faults_and_success_is_not():
    assert nccl_fault(Backend()) is None
    assert nccl_fault(Backend(ErrorType.COMM_ERROR)) == "NCCL reported COMM_ERROR"
    assert nccl_fault(Backend(ErrorType.REMOTE_ERROR)) == "NCCL reported REMOTE_ERROR"
    assert nccl_fault(Backend(ErrorType.TIMEOUT)) == "NCCL reported TIMEOUT"
    assert nccl_fault(Backend(raises=RuntimeError("communicator destroyed"))) == "RuntimeError: communicator destroyed"
    assert nccl_fault(object()) is None  # a torch whose backend cannot tell


def test_the_deadline_counts_from_when_the_device_reached_the_operation():
    reached = {"now": False}
    deadline = DeviceDeadline(lambda: reached["now"], timeout_s=10.0)
    assert not deadline.overdue(100.0)  # queued behind 60 s of compute: not yet its time
    assert not deadline.overdue(160.0)
    reached["now"] = True
    assert not deadline.overdue(160.0) and deadline.started_at == 160.0
    assert not deadline.overdue(169.9)
    assert deadline.overdue(170.1)  # 10 s after the device reached it
