"""The digits MLP, whose hot spares are held at their start: in a spare (ORCHESTRATOR_SLOT is `spare<k>`
while its workload is built) the factory waits until the file `gate` exists. A test keeps a spare
"starting" for as long as it needs (a scale made before the spare is ready), and lets it go."""
from __future__ import annotations

import os
import time

from orchestrator.workloads.digits import mlp


def make(gate: str, hidden: int = 32):
    while os.environ.get("ORCHESTRATOR_SLOT", "").startswith("spare") and not os.path.exists(gate):
        time.sleep(0.05)
    return mlp(hidden=hidden)
