"""The one place tests and benchmarks import their harnesses from; each lives in a module of its own:

- `local_group(n)` (actors/transport/comm.py `in_process_group`): n members of one gloo group in threads
  of this process, over a `HashStore` (no TCP store, no actors);
- `testkit/in_process.py`: doubles without Ray (policy oracles in milliseconds): `local_store`,
  `LocalJob` (real replicas in threads), `LocalLink`, `LocalServerReports`, `LoopbackComm`, `drive_step`;
- `testkit/ray_peers.py`: Ray actors that stand in for parts of a job: `CommPeer` (a communicator per
  membership epoch in a long-lived process), `FakeCoordinator`, `StoreHost`;
- `testkit/job_checks.py`: a job under test: `paced`, `wait_until`, `explain`, `wait_for_end`,
  `committed_samples`, `assert_batchnorm_trained`;
- `testkit/processes.py`: processes and ports a test starts: `child_env`, `free_port`, `start_run`,
  `sigkill_run_at`, `running`, `loaded_torch`.
"""
from __future__ import annotations

from actors.transport.comm import in_process_group as local_group
from testkit.in_process import (
    LocalJob,
    LocalLink,
    LocalServerReports,
    LoopbackComm,
    LoopbackHandle,
    drive_step,
    local_store,
)
from testkit.job_checks import PACE_S, assert_batchnorm_trained, committed_samples, explain, paced, wait_for_end, wait_until
from testkit.processes import (
    QUIET_PORTS_FROM,
    RAY_START_TIMED_OUT,
    child_env,
    free_port,
    loaded_torch,
    running,
    sigkill_run_at,
    start_run,
)
from testkit.ray_peers import CommPeer, FakeCoordinator, PeerGroup, StoreHost

__all__ = [
    "PACE_S", "QUIET_PORTS_FROM", "RAY_START_TIMED_OUT", "CommPeer", "FakeCoordinator", "LocalJob", "LocalLink",
    "LocalServerReports", "LoopbackComm", "LoopbackHandle", "PeerGroup", "StoreHost", "assert_batchnorm_trained",
    "child_env", "committed_samples", "drive_step", "explain", "free_port", "loaded_torch", "local_group",
    "local_store", "paced", "running", "sigkill_run_at", "start_run", "wait_for_end", "wait_until",
]
