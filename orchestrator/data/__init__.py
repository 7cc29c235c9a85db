"""Data sources a workload's factory can hand the orchestrator as its `train_data` (see docs/data.md)."""
