"""A worker's messages reach the real coordinator actor out of order: they still run in the order sent.

Ray starts an asyncio actor's tasks as they arrive, so two reports from one worker can run in either
order; here the later one is sent first, deliberately. History must still hold both steps, in order
(a record at or below a member's newest step is dropped as stale, so without the ordering step 1 is
lost), and a joiner's `state_received` sent before its first record must reach the reshape event.
"""
from __future__ import annotations

import time

import ray

from actors.control.coordinator import CoordinatorActor
from actors.plan import Progress
from actors.runs import runfiles
from orchestrator.config import config_from_dict


def _coordinator(tmp_path, name: str):
    cfg = config_from_dict({"name": name, "workers": {"count": 2, "cpus": 0.5},
                            "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 8},
                                         "batch_size": 8},
                            "sync": {"policy": "shadow"}, "stop": {"max_steps": 10}, "eval_every": 0})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # never started: no workers, no main loop; only its message handlers run
    return CoordinatorActor.options(name=name, namespace="orchestrator").remote(cfg.to_dict(), "r", str(run_dir)), run_dir


def _record(step: int) -> dict:
    return {"step": step, "time": time.time(), "loss": 1.0, "world_size": 2, "global_batch": 16, "micro_steps": 1,
            "membership_epoch": 1, "slot": "w0", "samples": 8}


def test_reports_sent_later_but_arriving_first_still_reach_history_in_order(ray_session, tmp_path):
    coord, run_dir = _coordinator(tmp_path, "order-reports")
    try:
        ray.get(coord.status.remote(), timeout=60)  # constructed
        sender = "w0/test"
        later = coord.report.remote(Progress("w0", 2, 1, time.time(), (_record(2),)), order=(sender, 1))
        time.sleep(0.2)  # the later report is surely running (waiting its turn) before the earlier arrives
        earlier = coord.report.remote(Progress("w0", 1, 1, time.time(), (_record(1),)), order=(sender, 0))
        ray.get([later, earlier], timeout=30)
        steps = [r["step"] for r in runfiles.read_jsonl(run_dir / "history.jsonl")]
        assert steps == [1, 2], steps
        waited_out = [e["reason"] for e in ray.get(coord.list_events.remote(), timeout=30) if "never came" in e["reason"]]
        assert not waited_out, f"the later report waited out its bound although the earlier one came: {waited_out}"
    finally:
        ray.kill(coord)
