"""Straggler detection end to end: `status` names a member whose step time is about 3x the others',
with its ratio, and an event records when it became one."""
from __future__ import annotations

import pytest

from orchestrator.config import config_from_dict
from orchestrator.job import ElasticJob
from testkit.harness import wait_until


@pytest.mark.slow  # the default tier's test of its mechanism: docs/testing.md, "The slow tier"
def test_status_names_a_3x_straggler_with_its_ratio_and_an_event_records_it(run_root):
    # w2's step takes 3x as long as it computed plus 3x the others' modelled 0.01 s: 3x theirs, whatever the
    # load on the machine makes of the compute itself (the ratio is of modelled times, not a bound on time)
    cfg = {"name": "stragglers", "seed": 2, "workers": {"count": 3, "cpus": 0.5},
           "workload": {"factory": "orchestrator.workloads.digits:mlp", "params": {"hidden": 32}, "batch_size": 8},
           "optimizer": {"lr": 0.05}, "stop": {"max_steps": 400}, "eval_every": 0,
           "faults": {"stragglers": [{"slot": "w0", "delay_s": 0.01}, {"slot": "w1", "delay_s": 0.01},
                                     {"slot": "w2", "slowdown": 3.0, "delay_s": 0.03}]}}
    job = ElasticJob(config_from_dict(cfg)).start()
    try:
        wait_until(lambda: job.status().stragglers, timeout=60, what="a straggler named")
        status = wait_until(lambda: (s := job.status()).step >= 150 and s, timeout=60, what="step 150")
        print(f"status at step {status.step}: stragglers {status.stragglers}")
        assert set(status.stragglers) == {"w2"} and 2.0 < status.stragglers["w2"] < 4.0, status.stragglers
        events = [e for e in job.events() if e["kind"] == "straggler"]
        assert events and events[0]["detail"]["slot"] == "w2" and events[0]["detail"]["straggler"] is True, events
        print(events[0]["reason"])
    finally:
        job.stop()
