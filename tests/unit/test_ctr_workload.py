"""The CTR workload: deterministic synthetic logs with a known best AUC that a model can approach."""
from __future__ import annotations

import numpy as np
import torch

from orchestrator.workloads.ctr import auc, ctr


def test_rank_auc_matches_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    scores, labels = np.round(rng.random(300), 1), (rng.random(300) < 0.4).astype(float)
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    pairwise = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert abs(auc(scores, labels) - pairwise) < 1e-12
    assert auc(scores, np.zeros(300)) == 0.5


def test_logs_are_the_same_every_time_and_a_model_gets_within_0025_of_the_best_auc():
    a, b = ctr(samples=60_000), ctr(samples=60_000)
    assert all(torch.equal(x, y) for x, y in zip(a.train_data.tensors, b.train_data.tensors))
    torch.manual_seed(0)
    work = a
    opt = torch.optim.Adam(work.model.parameters(), lr=0.003)
    sparse, dense, clicks = work.train_data.tensors
    generator = torch.Generator().manual_seed(0)
    before = work.evaluate(work.model, work.eval_data)["auc"]
    for _ in range(1500):
        idx = torch.randint(0, len(clicks), (128,), generator=generator)
        loss = work.loss(work.model, (sparse[idx], dense[idx], clicks[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = work.evaluate(work.model, work.eval_data)
    print(f"ctr: best AUC {work.best_auc:.4f}, before training {before:.4f}, after 1500 steps {after['auc']:.4f}, "
          f"log loss {after['log_loss']:.4f} (best {work.best_log_loss:.4f})")
    assert work.best_auc - after["auc"] < 0.025 and after["auc"] > before + 0.1
