"""The processes and the bytes: the coordinator's and the workers' actors, transports, run files.

`REMOTE_HOME`: each Ray actor class here names `orchestrator.remote` as its module, so that a worker
process imports `orchestrator` (whose `__init__` puts this project's packages first) before this package:
see orchestrator/remote.py. Only the name is used here; nothing in `actors` imports `orchestrator`."""

REMOTE_HOME = "orchestrator.remote"
