"""The coordinator's parts, each owning one part of what it knows and does (one writer per field).

`actors/control/coordinator.py` is the actor: a thin shell that builds these, takes the calls of
drivers, workers and the parameter server, and hands each to the part that owns it.

- `job_state.JobStateMachine`: the job's state, cause, decided stop and times; its checked transitions.
- `plans.Plans`: plans and reshapes, convergence on the target count, re-forms, scales, the policy trial.
- `records.Records`: records accepted into history, and what a newest one closes.
- `lifecycle.Lifecycle`: the main task, from the start (or a restart's recovery) to the end and linger.
- `restart.StateFile`: the state file a restarted incarnation carries on from.
- `book.MembershipBook`: members and slots, membership epochs, plans and the reshapes they open.
- `journal.Journal`: the run directory (events, history, the state file) and progress; its
  `checkpoint_store.CheckpointStore` keeps checkpoints and the final model.
- `spares.SparePool`, `launcher.Launcher`, `admission.Admission`: hot spares, starting a slot's worker
  (a spare or a fresh actor) and counting its failures, admitting ready workers into plans.
- `supervisor.Supervisor`: each worker's outcome (taken in batches by `outcomes.Outcomes`), heartbeats,
  probes and evictions, fed to `algorithms/supervision.decide` with the decision carried out through
  the shell's `Actions`.
- `workers.WorkerGroup`: everything the coordinator asks of Ray about workers (the seam that
  `testkit/fake_workers.FakeWorkerGroup` replaces in unit tests and the control-plane benchmark).
"""
