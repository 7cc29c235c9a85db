"""Rank 0's checkpoints written off the step loop: the committed state is copied to host memory at its
step (a GPU's tensors into pinned buffers, on a side stream that waits for the step's work: the host
does not wait), then a thread serializes the copy and hands it to the coordinator, while training goes on.

`checkpoint.background` says when: unset, for a model on a GPU (there, serializing on the step loop
held every rank at the next collective while rank 0 copied the state to the host); `true` on the CPU
too, where the copy is a second state's worth of memory while it is written; `false` never.

One checkpoint is written at a time: the next one's step waits for the previous one's write, so at
most one copy of the state is held for it. An error of a write (the coordinator gone) is raised on
the step loop at the next checkpoint or at the run's end, as an error of a synchronous write was.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from actors.streams import process_stream
from actors.training.state_transfer import map_state_tensors


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint at its step: `serialize()` makes its bytes; `background` says it may run in a
    thread (it serializes a copy, not the live state)."""

    serialize: Callable[[], bytes]
    background: bool


def host_copy(state: Any) -> tuple[Any, torch.cuda.Event | None]:
    """`state` with every tensor copied to host memory (rebuilt as `map_state_tensors` rebuilds it: a state
    dict keeps its type and `_metadata`), and the event after which a GPU's copies are complete (None where
    none was on a GPU). A GPU's tensors go into pinned buffers, copied on the side stream after the current
    stream's work, and the current stream's later work waits for the copies (the host waits for neither)."""
    side: torch.cuda.Stream | None = None

    def copy(value: torch.Tensor) -> torch.Tensor:
        nonlocal side
        value = value.detach()
        if not value.is_cuda:
            return value.clone()
        if side is None:
            side = process_stream("checkpoint copies", value.device)
            side.wait_stream(torch.cuda.current_stream(value.device))
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(value, non_blocking=True)
            value.record_stream(side)  # the caching allocator keeps it until the copy is done
        return host

    copied = map_state_tensors(state, copy)
    if side is None:
        return copied, None
    done = torch.cuda.Event()
    done.record(side)
    # the step's later work (the optimizer writing the parameters) is ordered after the copies, on the
    # GPU: the host goes on at once
    torch.cuda.current_stream(side.device).wait_event(done)
    return copied, done


class CheckpointWriter:
    """Hands rank 0's checkpoints to `save(step, blob)`: at once, or (`Checkpoint.background`) from a
    thread, one at a time."""

    def __init__(self, save: Callable[[int, bytes], None]) -> None:
        self._save = save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: list[int] = []
        """The steps whose checkpoints were handed over, in order."""

    def submit(self, step: int, checkpoint: Checkpoint) -> None:
        """Write `checkpoint` (of `step`) after the previous one; raises the previous one's error."""
        self.wait()
        if not checkpoint.background:
            self._write(step, checkpoint.serialize)
            self.wait()
            return
        self._thread = threading.Thread(target=self._write, args=(step, checkpoint.serialize),
                                        name=f"checkpoint {step}", daemon=True)
        self._thread.start()

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Once the checkpoint in writing is handed over; raises its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, step: int, serialize: Callable[[], bytes]) -> None:
        try:
            self._save(step, serialize())
            self.written.append(step)
        except BaseException as err:  # noqa: BLE001 - raised on the step loop by `wait`
            self._error = err
