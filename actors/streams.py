"""The process's own CUDA side streams, one per purpose and device, made on first use and kept: a stream
made per use (per epoch, per checkpoint) draws a new one from torch's pool of 32 each time and comes to
alias the others' (the loader's copy stream among them)."""
from __future__ import annotations

import threading
from typing import Any

import torch

_streams: dict[tuple[str, int], Any] = {}
_lock = threading.Lock()


def process_stream(purpose: str, device: torch.device) -> Any:  # pragma: no cover - needs a GPU
    """This process's stream for `purpose` ("nccl completions", "checkpoint copies") on `device`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if (purpose, index) not in _streams:
            _streams[(purpose, index)] = torch.cuda.Stream(device=device)
        return _streams[(purpose, index)]
