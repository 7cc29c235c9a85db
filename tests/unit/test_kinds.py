"""The policy kinds as objects (algorithms/rules/kinds.py): what each answers, that every policy has the one
its row names, that code asks a kind instead of comparing its name, and the coordinator's torch-free start."""
from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from algorithms.policies.base import get_algorithm, known_policies
from algorithms.rules.kinds import (
    BACKGROUND,
    DECENTRALIZED,
    KINDS,
    PERIODIC,
    POLICY_KINDS,
    SERVER,
    SYNCHRONOUS,
    Entry,
    FinalModel,
    PolicyTraits,
    Reporter,
)

REPO = Path(__file__).resolve().parents[2]


def test_every_policy_has_the_kind_its_class_declares():
    assert set(POLICY_KINDS) == set(known_policies())
    wrong = {name: get_algorithm(name).kind for name in known_policies() if get_algorithm(name).kind is not POLICY_KINDS[name]}
    assert not wrong, wrong


@pytest.mark.parametrize("name", sorted(POLICY_KINDS))
def test_traits_answer_as_the_policy_does(name):
    algorithm, traits = get_algorithm(name)(None), PolicyTraits(name)
    for attribute in ("kind", "entry", "reporter", "final_model", "counts_steps", "local_mean"):
        assert getattr(traits, attribute) is getattr(algorithm, attribute), attribute


# kind: entry, reporter, final model, (runs a server, dispenses leases, members hold state, local mean,
# every step one reduction, every plan a new epoch, background rounds)
ANSWERS = {
    SYNCHRONOUS: (Entry.REPLICATED, Reporter.RANK0, FinalModel.RANK0, (False, False, True, False, True, False, False)),
    PERIODIC: (Entry.REPLICATED, Reporter.RANK0, FinalModel.RANK0, (False, False, True, True, False, False, False)),
    SERVER: (Entry.SERVER, Reporter.SERVER, FinalModel.SERVER, (True, False, False, False, False, False, False)),
    DECENTRALIZED: (Entry.AVERAGE, Reporter.EACH, FinalModel.AVERAGE, (False, False, True, True, False, True, False)),
    BACKGROUND: (Entry.NONE, Reporter.EACH, FinalModel.AVERAGE, (True, True, True, True, False, False, True)),
}


@pytest.mark.parametrize("kind", list(ANSWERS), ids=str)
def test_each_kind_answers_as_the_policies_page_says(kind):
    entry, reporter, final, flags = ANSWERS[kind]
    assert (kind.entry, kind.reporter, kind.final_model) == (entry, reporter, final)
    assert (kind.runs_server, kind.dispenses_leases, kind.members_hold_state, kind.local_mean, kind.reduces_every_step,
            kind.new_epoch_each_plan, kind.background_rounds) == flags
    assert kind.counts_steps == kind.members_hold_state == (not kind.pushes_each_step)
    assert set(KINDS.values()) == set(ANSWERS)


def test_the_entries_and_reporters_answer_by_behaviour():
    assert [e for e in Entry if e.forms_group] == [Entry.REPLICATED, Entry.AVERAGE, Entry.SHARDED]
    assert [e for e in Entry if e.agrees_on_step] == [Entry.REPLICATED, Entry.SHARDED]
    assert [(r.reports_from(0), r.reports_from(1)) for r in Reporter] == [(True, False), (True, True), (False, False)]
    assert [f for f in FinalModel if f.averages_replicas] == [FinalModel.AVERAGE]
    assert SERVER.server_role == "parameter server" and BACKGROUND.server_role == "lease dispenser"


def test_a_kind_reads_as_its_name_and_equals_only_itself():
    """Events, errors and the metrics' labels say the same words as before kinds were objects; a comparison
    with a name is never true (so it cannot pass unnoticed), and a kind sent to another process is the
    same instance there."""
    assert [str(k) for k in KINDS.values()] == list(KINDS)
    assert f"{BACKGROUND} {Entry.AVERAGE} {Reporter.RANK0} {FinalModel.SERVER}" == "background average rank0 server"
    assert [k.traffic for k in KINDS.values()] == ["gradients", "rounds", "pushes", "exchanges", "background rounds"]
    assert SERVER != "server" and Entry.NONE != "none" and Reporter.EACH != "each"  # type: ignore[comparison-overlap]
    assert all(pickle.loads(pickle.dumps(k)) is k for k in (*KINDS.values(), *Entry, *Reporter, *FinalModel))


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


# ------------------------------------------------------------------ no kind chosen by its name
TABLE = REPO / "algorithms" / "rules" / "kinds.py"
"""The one module that defines the kinds: the only place their names are spelled."""
NAMES = set(KINDS) | {str(v) for v in (*Entry, *Reporter, *FinalModel)}
ASKED = {"kind", "entry", "reporter", "final_model"}


def _asked(node: ast.expr) -> bool:
    """A kind, an entry, a reporter or a final model (or its `.name`/`.value`); an event's `kind` is the
    journal's vocabulary (transition, reshape, server, ...), not a policy kind."""
    if isinstance(node, ast.Attribute) and node.attr in ("name", "value"):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr in ASKED and not (isinstance(node.value, ast.Name) and node.value.id in ("event", "e"))
    return isinstance(node, ast.Name) and node.id in ASKED


def _spelled(node: ast.expr) -> set[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.Set, ast.List)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)} & NAMES


def comparisons_of_names(path: Path, root: Path = REPO) -> list[str]:
    """Every comparison in `path` of a kind, an entry, a reporter or a final model with a string naming one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for a, b in zip(operands, operands[1:]):
                if (_asked(a) and _spelled(b)) or (_asked(b) and _spelled(a)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_code_asks_a_kind_and_never_compares_its_name():
    """`kind.runs_server`, `reporter.each_member_reports`, `entry.forms_group`: a comparison with a name
    hides a kind's behaviour from the table and breaks silently when a kind is added or renamed."""
    found = [line for top in ("core", "algorithms", "actors", "orchestrator", "testkit")
             for path in sorted((REPO / top).rglob("*.py"))
             if path != TABLE
             for line in comparisons_of_names(path)]
    assert not found, "ask the kind (algorithms/rules/kinds.py) instead:\n" + "\n".join(found)


def test_the_scan_finds_a_comparison_of_a_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('def f(algorithm, history, event):\n'
                      '    return (algorithm.kind == "background", history.reporter.name in ("each", "rank0"),\n'
                      '            "replicated" != algorithm.entry, event.kind == "server", algorithm.kind.runs_server)\n')
    assert [line.split(": ", 1)[1] for line in comparisons_of_names(sample, tmp_path)] == [
        "algorithm.kind == 'background'", "history.reporter.name in ('each', 'rank0')", "'replicated' != algorithm.entry"]
