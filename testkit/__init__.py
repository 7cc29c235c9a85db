"""Test doubles and harnesses shared by `tests/` and `benchmarks/`: not part of the installed product.

- `testkit.harness`: where tests import their harnesses from (re-exports): in-process groups and jobs
  (`testkit.in_process`: real replicas in threads, no Ray), Ray actors that host a communicator or stand
  in for a coordinator (`testkit.ray_peers`), a job under test (`testkit.job_checks`: pacing, waiting,
  explaining) and processes a test starts (`testkit.processes`);
- `testkit.fake_workers`: `FakeWorkerGroup`, the coordinator's worker seam answered in-process;
- the sides of the comparisons that the benchmarks print and the slow tier gates: `testkit.ddp_pair` (BSP
  and torch DDP), `testkit.recovery_side` (deaths and a join), `testkit.compression_sides`, and what a
  comparison with another system measures on both sides, `testkit.peers`.

The package lives at the repository's root, beside the product's packages, and is left out of the wheel
(`pyproject.toml` lists the packages it ships). Ray's worker processes import it by the same name: a
local Ray puts the driver's working directory (the repository root, where the tests and benchmarks are
run from) on its workers' `sys.path`.
"""
