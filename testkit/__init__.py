"""Test doubles and harnesses shared by `tests/` and `benchmarks/`: not part of the installed product.

- `testkit.harness`: in-process groups and jobs (real replicas in threads, no Ray), Ray actors that host
  a communicator or stand in for a coordinator, and helpers for tests that start processes;
- `testkit.fake_workers`: `FakeWorkerGroup`, the coordinator's worker seam answered in-process.

The package lives at the repository's root, beside the product's packages, and is left out of the wheel
(`pyproject.toml` lists the packages it ships). Ray's worker processes import it by the same name: a
local Ray puts the driver's working directory (the repository root, where the tests and benchmarks are
run from) on its workers' `sys.path`.
"""
