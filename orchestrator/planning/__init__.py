"""The parts of `plan` and `sync.policy: auto`, one idea per module; `orchestrator/planner.py` is their
entry (what the CLI and `ElasticJob.start` call) and re-exports every name below.

- `candidates.py`: the policies a job could run with, and the config each one makes;
- `cluster.py`: the network and the compute the runtime model predicts on (as told, as probed in the lab,
  as measured on the user's cluster);
- `measure.py`: what is timed on this machine (one step's compute, each synchronization pattern's host time);
- `ranking.py`: each candidate's prediction, the convergence factors and the recommendation's order;
- `report.py`: the printed table and the one-line recommendation.
"""
