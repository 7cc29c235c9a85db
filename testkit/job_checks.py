"""A job under test: paced so that it leaves the cores to the tests beside it, waited on, explained (its
state, events and logs) when a test gave up on it, and judged by what it left (the committed samples, a
trained model's BatchNorm statistics)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PACE_S = 0.02
"""What `paced` gives each step of a test job at least: some five times a digits step's compute here."""


def paced(cfg: dict, delay_s: float = PACE_S) -> dict:
    """`cfg` (a plain config dict) with every slot's steps taking at least `delay_s` (a modelled compute
    time: `faults.stragglers` on every slot, which combine with the config's own by the largest delay).
    A job that trains until the test has seen what it waits for then leaves the cores to the tests
    beside it, instead of burning them on steps nobody looks at; numbers are unchanged (a sleep)."""
    workers = cfg.get("workers", {})
    slots = workers.get("max") or workers.get("count", 1)
    faults = dict(cfg.get("faults", {}))
    faults["stragglers"] = list(faults.get("stragglers", [])) + [{"slot": f"w{i}", "delay_s": delay_s}
                                                                 for i in range(slots)]
    return {**cfg, "faults": faults}


def assert_batchnorm_trained(model: torch.nn.Module, label: str) -> None:
    """`digits:bn_mlp`'s final model carries its BatchNorm statistics (not their initial values) and
    evaluates well in eval mode, which depends on them."""
    from torch.utils.data import TensorDataset

    from orchestrator.workloads.digits import accuracy, bn_mlp

    assert isinstance(model, torch.nn.Sequential), f"{label}: not digits:bn_mlp's model ({type(model).__name__})"
    bn = model[1]
    assert isinstance(bn, torch.nn.BatchNorm1d) and bn.num_batches_tracked is not None \
        and bn.running_mean is not None and bn.running_var is not None, f"{label}: its layer 1 keeps no BatchNorm statistics"
    tracked = int(bn.num_batches_tracked)
    moved = float(bn.running_mean.abs().max())
    eval_data = bn_mlp().eval_data
    assert isinstance(eval_data, TensorDataset)
    acc = accuracy(model, eval_data)["accuracy"]
    print(f"{label}: num_batches_tracked {tracked}, max |running_mean| {moved:.3f}, eval-mode accuracy {acc:.3f}")
    assert tracked > 0 and moved > 0.0, "the final model's BatchNorm statistics are their initial values"
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    assert acc > 0.6


def committed_samples(run_dir: Path, history: list[dict]) -> dict[int, list[int]]:
    """Each committed step's sample ids, over every member's ledger (`faults.record_samples`) in
    `run_dir`, for the steps of `history`: a line counts when its membership epoch is the one history
    committed the step in (a step applied only by departed members was redone later)."""
    committed_in = {r["step"]: r["membership_epoch"] for r in history}
    per_step: dict[int, list[int]] = {}
    for path in (Path(run_dir) / "samples").glob("*.txt"):
        for line in path.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            if committed_in.get(step) == epoch:
                per_step.setdefault(step, []).extend(ids)
    return per_step


def wait_until(predicate: Callable[[], Any], timeout: float = 90, what: str = "condition", every: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy and return its value; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


async def until(condition: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """`wait_until` inside an event loop (the coordinator's, in process): the loop runs while it polls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def explain(job: Any, since: float | None = None, lines: int = 15) -> str:
    """What a job was doing, for a test that gave up on it: its state, its events (from `since`, a
    time.time(), on; all if None), and the tail of its coordinator's and each worker's (and the
    server's) log. `job` is an `ElasticJob` (anything with status() and events())."""
    status = job.status()
    origin = since or 0.0  # times relative to `since`; absolute without it
    out = [f"state {status.state} at step {status.step}, epoch {status.membership_epoch}, cause {status.cause!r}; "
           f"members {[(m.slot, m.state, m.pid) for m in status.members]}; server {status.server}"]
    for e in job.events():
        if e["time"] >= origin - 1.0:
            detail = {k: v for k, v in (e.get("detail") or {}).items() if k in ("slot", "detector", "seen_at", "step")}
            out.append(f"{e['time'] - origin:+10.3f} {e['kind']} {e.get('state_to') or ''}: "
                       f"{e.get('reason', '')[:200]} {detail or ''}")
    run_dir = Path(status.run_dir)
    for log in [run_dir / "coordinator.log"] + sorted((run_dir / "workers").glob("*.log")):
        if log.exists():
            out += [f"--- {log.name}"] + log.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(out)


def wait_for_end(job: Any, timeout: float, since: float | None = None) -> Any:
    """`job.wait(timeout)`, failing with `explain` (what the job was doing) when it does not end in time."""
    try:
        return job.wait(timeout=timeout)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{explain(job, since)}") from None


