"""The coordinator's components, each owning one part of what it knows and does.

`actors/control/coordinator.py` is the actor: a thin shell that wires these together, takes the calls of
drivers and workers, and runs the job's state machine.

- `book.MembershipBook`: members and slots, membership epochs, plans and the reshapes they open.
- `journal.Journal`: the run directory (events, history, the state file, checkpoints) and progress.
- `spares.SparePool`: hot spares, started, kept and handed over.
- `launcher.Launcher`: starting a slot's worker (a spare or a fresh actor) and counting its failures.
- `supervisor.Supervisor`: each worker's outcome, heartbeats, probes and evictions, fed to
  `algorithms/supervision.decide` with the decision carried out through the shell's `Actions`.
- `workers.WorkerGroup`: everything the coordinator asks of Ray about workers (the seam that
  `fake.FakeWorkerGroup` replaces in unit tests and the control-plane benchmark).
"""
