"""The vocabulary every layer shares: the config and status types, the errors, the workload loader.

Folders import in one direction: `orchestrator/` (talks to people) -> `actors/` (moves bytes and
holds state) -> `algorithms/` (decides) -> `core/`. Nothing here imports Ray or a backend.
"""
