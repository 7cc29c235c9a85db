"""A hot spare imports ahead everything its adoption and its first epoch import
(`actors.training.worker.prepare_spare`): an adoption that compiled `actors.server.server_client` and its modules
from source held a join 0.14-0.18 s, and the first epoch's import of ray.util.collective 0.13 s more."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.harness import child_env

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import json, sys
import actors.training.worker  # what Ray imports for the actor class
from actors.training.worker import prepare_spare
from orchestrator.config import config_from_dict

prepare_spare(config_from_dict({"name": "spare", "workload": {"factory": "orchestrator.workloads.digits:mlp",
                                                              "params": {"hidden": 8}}}))
ours = ("actors.", "algorithms.", "core.", "orchestrator.", "ray.util.collective")
before = set(sys.modules)
import actors.training.replica, actors.server.server_client  # what Worker._become imports
from actors.transport.collective import _ray_collective
_ray_collective()  # what the first epoch's `collective.publish` imports
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith(ours))))
"""


def test_a_spare_has_imported_every_module_its_adoption_imports():
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=child_env(REPO), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


FIRST_STEP = r"""
import sys
import actors.training.worker  # what Ray imports for the actor class
from actors.training.worker import prepare_spare
from orchestrator.config import config_from_dict

assert "numpy.random._generator" not in sys.modules, "imported before the spare's preparation: this shows nothing"
prepare_spare(config_from_dict({"name": "spare", "workload": {"factory": "orchestrator.workloads.digits:mlp",
                                                              "params": {"hidden": 8}}}))
print("numpy.random._generator" in sys.modules)
"""


def test_a_spare_pays_its_first_steps_import_of_numpys_random_generator_ahead():
    """The joiner's first step draws the data epoch's permutation (algorithms/rules/sampler.py), whose first
    use imports numpy.random: 10-13 ms of a join from a spare, which every member waits for."""
    out = subprocess.run([sys.executable, "-c", FIRST_STEP], cwd=REPO, env=child_env(REPO), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
