"""Evaluation split across the members (actors/training/evaluation.py): under bsp, each member evaluates
its own share of the held-out data and the metric is the mean over all of it, exact for uneven shares;
the reference is written from the definition (every loss token's cross-entropy, summed, over their
count). Where the evaluation is a plain function, or the kind's members are not in lockstep, rank 0
evaluates all of the data alone, as before."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from core.workload_api import MeanEvaluation
from testkit.harness import LocalJob

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")
import orchestrator.workloads.hf as hf

SEED, STEPS, EVAL_ITEMS = 3, 4, 16
PADDED = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "resid_pdrop": 0.0,
          "embd_pdrop": 0.0, "attn_pdrop": 0.0, "data": "tests.workloads.padded_text:make", "eval_count": EVAL_ITEMS}
"""Rows of 3 to 16 real tokens padded to 16: the members' shares hold different numbers of loss tokens."""


def config(world: int, policy: str = "bsp") -> dict:
    return {"name": "eval-split", "seed": SEED, "workers": {"count": world, "cpus": 0.5},
            "workload": {"factory": "orchestrator.workloads.hf:causal_lm", "params": PADDED, "batch_size": 12 // world},
            "optimizer": {"name": "sgd", "lr": 0.5}, "sync": {"policy": policy},
            "stop": {"max_steps": STEPS}, "eval_every": STEPS}


def token_mean(model: torch.nn.Module, data) -> float:
    """The held-out loss from its definition: each row's next-token cross-entropy over its loss tokens
    (labels shifted once, -100 ignored), summed over all rows, over the number of those tokens."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(len(data)):
            item = data[i]
            logits = model(input_ids=item["input_ids"][None], attention_mask=item["attention_mask"][None]).logits[0, :-1]
            targets = item["labels"][1:]
            keep = targets != -100
            total += float(F.cross_entropy(logits[keep].double(), targets[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


class Spy:
    """Wraps the workload's evaluation: which thread (member) evaluated how many items, and its sums."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, tuple[float, float]]] = []
        self._lock = threading.Lock()

    def wrap(self, real: MeanEvaluation) -> MeanEvaluation:
        def sums(model, data):
            out = real.sums(model, data)
            with self._lock:
                self.calls.append((threading.current_thread().name, len(data), out["eval_loss"]))
            return out
        return MeanEvaluation(sums, real.derived)


@pytest.mark.parametrize("world", [2, 3])
def test_each_member_evaluates_its_share_and_the_metric_is_the_token_mean_over_all(tmp_path, monkeypatch, world):
    spy = Spy()
    real = hf.causal_lm
    monkeypatch.setattr(hf, "causal_lm", lambda **kw: (lambda w: setattr(w, "evaluate", spy.wrap(w.evaluate)) or w)(real(**kw)))
    slots = [f"w{i}" for i in range(world)]
    job = LocalJob(config(world), slots, str(tmp_path))
    job.run(tuple(slots), 12)
    evaluated = [r for r in job.link.records if "metrics" in r]
    assert [r["step"] for r in evaluated] == [STEPS]
    ours = evaluated[0]["metrics"]["eval_loss"]

    assert sorted(n for _, n, _ in spy.calls) == sorted((r + 1) * EVAL_ITEMS // world - r * EVAL_ITEMS // world
                                                        for r in range(world))
    assert len({thread for thread, _, _ in spy.calls}) == world  # one share in each member, none of all the data
    held = real(**PADDED).eval_data
    reference = token_mean(job.replicas["w0"].training.model, held)
    mean_of_means = sum(t / w for _, _, (t, w) in spy.calls) / world
    off, averaged_off = abs(ours - reference) / reference, abs(mean_of_means - reference) / reference
    print(f"{world} members: split {ours:.9f}, one process's token mean {reference:.9f} (relative {off:.1e}), "
          f"the members' means averaged {mean_of_means:.9f} (relative {averaged_off:.1e})")
    # float32 logits, computed in batches where the reference takes one row at a time: their rounding, under
    # 1e-6 relative (3e-9 and 3e-8 measured here); an average of the shares' means is off by 3e-5 to 8e-5
    assert abs(ours - reference) < 1e-6 * reference
    assert abs(evaluated[0]["metrics"]["perplexity"] - torch.tensor(ours).exp().item()) < 1e-3
    assert abs(mean_of_means - reference) > 1e-5 * reference  # what an average of the shares' means would be off by


def test_a_plain_evaluate_or_a_kind_out_of_lockstep_is_evaluated_by_rank_0_over_all_of_the_data(tmp_path, monkeypatch):
    spy = Spy()
    real = hf.causal_lm

    def plain(**kw):
        w = real(**kw)
        wrapped = spy.wrap(w.evaluate)
        w.evaluate = lambda model, data: wrapped(model, data)  # a plain function: nothing says its metrics are means
        return w
    monkeypatch.setattr(hf, "causal_lm", plain)
    job = LocalJob(config(2), ["w0", "w1"], str(tmp_path / "plain"))
    job.run(("w0", "w1"), 12)
    assert [(thread, n) for thread, n, _ in spy.calls] == [("replica w0", EVAL_ITEMS)]

    spy.calls.clear()
    monkeypatch.setattr(hf, "causal_lm", lambda **kw: (lambda w: setattr(w, "evaluate", spy.wrap(w.evaluate)) or w)(real(**kw)))
    cfg = config(2, "local_sgd")
    cfg["sync"]["h"] = 2
    job = LocalJob(cfg, ["w0", "w1"], str(tmp_path / "periodic"))
    job.run(("w0", "w1"), 12)
    assert [(thread, n) for thread, n, _ in spy.calls] == [("replica w0", EVAL_ITEMS)]
