"""What a comparison with another system needs on both sides (the benchmarks' and the slow tier's speed
gates'): the peak resident set of a side's worker processes, sampled the same way on every side; a plain
DDP side's rendezvous; a workload built for a peer (DDP, Ray Train) as its user writes it."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil


class PeakRSS:
    """The largest RSS of any process of a set (`pids()`, asked every sample), sampled every 0.1 s in
    a thread; `stop()` returns it in MiB."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.peak = 0
        self._pids = pids
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @classmethod
    def of_job(cls, job, workers: int | None = None) -> PeakRSS:
        """A job's worker processes, asked of its coordinator until `workers` of them are known (every
        sample when `workers` is None), not once per sample."""
        known: list[int] = []

        def pids() -> list[int]:
            if workers is None or len(known) < workers:
                try:
                    known[:] = [m.pid for m in job.status().members if m.pid] or known
                except Exception:  # noqa: BLE001 - the job is ending: keep sampling the ones known
                    pass
            return known
        return cls(pids)

    def _poll(self) -> None:
        procs: dict[int, psutil.Process] = {}
        while not self._done.is_set():
            for pid in self._pids():
                try:
                    proc = procs.setdefault(pid, psutil.Process(pid))
                    self.peak = max(self.peak, proc.memory_info().rss)
                except psutil.Error:  # the process ended mid-poll
                    pass
            self._done.wait(0.1)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak / 2**20


def ddp_store(rank: int, out_dir: str, world: int):
    """A plain DDP side's rendezvous: rank 0's TCPStore takes a port the kernel picks (no free-port
    race with other processes) and publishes it in `out_dir`; the other ranks wait for it there."""
    import torch.distributed as dist

    path = Path(out_dir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
        Path(out_dir, "port.tmp").write_text(str(store.port))
        os.replace(Path(out_dir, "port.tmp"), path)
        return store
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never published its store port")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(path.read_text()), world, False)


def peer_workload(spec: dict, seed: int, **optimizer_options: Any) -> tuple[Any, Callable[[Any], Any]]:
    """A benchmark's workload (`spec`: its `factory`, `params` and `optimizer` as a job's config gives
    them), seeded as a job seeds it, and a factory of torch's own optimizer for it: what a peer's user
    (DDP, Ray Train) writes. `optimizer_options` go to the optimizer as well (`foreach=False`)."""
    import torch

    from core.factory import check_factory

    torch.manual_seed(seed)
    workload = check_factory(spec["factory"])(**spec["params"])
    options = dict(spec["optimizer"], **optimizer_options)
    if options.pop("name") == "sgd":
        return workload, lambda params: torch.optim.SGD(params, **options)
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return workload, lambda params: torch.optim.AdamW(params, **options)
