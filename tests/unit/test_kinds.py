"""The coordinator's view of the policies (algorithms/rules/kinds.py) and its torch-free start."""
from __future__ import annotations

import subprocess
import sys

import pytest

from algorithms.policies.base import get_algorithm, known_policies
from algorithms.rules.kinds import POLICY_KINDS, PolicyTraits


def test_every_policy_has_the_kind_its_class_declares():
    assert POLICY_KINDS == {name: get_algorithm(name).kind for name in known_policies()}


@pytest.mark.parametrize("name", sorted(POLICY_KINDS))
def test_traits_answer_as_the_policy_does(name):
    algorithm, traits = get_algorithm(name)(None), PolicyTraits(name)
    for attribute in ("kind", "entry", "reporter", "final_model", "counts_steps", "local_mean"):
        assert getattr(traits, attribute) == getattr(algorithm, attribute), attribute


def test_an_unknown_policy_is_named():
    with pytest.raises(KeyError, match="unknown policy 'nope'"):
        PolicyTraits("nope")


def test_the_control_side_imports_no_torch():
    """The coordinator's process starts the first workers while torch loads in a thread (its store
    needs torch.distributed), and the CLI's status, scale and stop answer without loading it:
    importing what they need must not pull torch in."""
    code = ("import sys, actors.control.coordinator, actors.training.worker, actors.control.server_control, "
            "orchestrator.cli, orchestrator.job; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:5])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
