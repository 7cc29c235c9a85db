"""Click-through-rate prediction on synthetic click logs: embedding tables, dense layers and their
interactions (the shape of DLRM).

The recommendation models background synchronization is meant for: sparse categorical features
(each field a bag of ids, looked up in its own `nn.EmbeddingBag` and summed) and dense features
(through a bottom MLP) meet in their pairwise dot products, which a top MLP turns into one logit.

The logs are drawn with a fixed seed from a hidden ground-truth model, so there is something real
to learn and a known ceiling: each id of each field has a true weight, the dense features a true
linear weight, pairs of fields a true interaction (the inner product of two-dimensional hidden
factors of their ids, as a factorization machine has), and a click is Bernoulli(sigmoid(logit)). The
held-out AUC of the true click probabilities (`best_auc`) is the best any model can reach on that
data; `evaluate` reports log loss and AUC next to it. Field sizes follow a power law (a few very
frequent ids, a long tail), as in real click logs.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from orchestrator.workloads import Workload


class CTRModel(nn.Module):
    """DLRM's shape, small: one `EmbeddingBag` (sum) per field and a bottom MLP for the dense features
    give F + 1 vectors of `dim`; the vectors and their pairwise dot products (the feature
    interactions) go through a top MLP to one logit."""

    def __init__(self, vocab: tuple[int, ...], bag: int, dense: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.bag = bag
        self.tables = nn.ModuleList(nn.EmbeddingBag(v, dim, mode="sum") for v in vocab)
        self.bottom = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU())
        vectors = len(vocab) + 1
        self.pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.top = nn.Sequential(nn.Linear(vectors * dim + vectors * (vectors - 1) // 2, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        bags = [table(sparse[:, f * self.bag:(f + 1) * self.bag]) for f, table in enumerate(self.tables)]
        vectors = torch.stack([x] + bags, dim=1)  # (batch, F + 1, dim)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([vectors.flatten(1), dots], dim=1)).squeeze(1)


@lru_cache(maxsize=4)
def click_logs(samples: int, fields: int, vocab: int, bag: int, dense: int, seed: int) -> dict[str, np.ndarray]:
    """`samples` logs from the hidden model (80% train, 20% held out), and its true click probabilities."""
    rng = np.random.default_rng(seed)
    sizes = [max(8, int(vocab / (f + 1) ** 0.5)) for f in range(fields)]
    weights = [rng.normal(0.0, 0.6, size) for size in sizes]
    dense_w = rng.normal(0.0, 0.5, dense)
    factors = [rng.normal(0.0, 0.5, (size, 2)) for size in sizes]  # for the pairwise (FM-style) terms
    pairs = [(f, (f + 1) % fields) for f in range(0, fields, 2)]
    ids = np.empty((samples, fields * bag), dtype=np.int64)
    logit = np.full(samples, -1.0)
    for f, size in enumerate(sizes):
        draws = np.minimum(rng.zipf(1.3, (samples, bag)) - 1, size - 1)  # frequent ids and a long tail
        ids[:, f * bag:(f + 1) * bag] = draws
        logit += weights[f][draws].sum(1) / bag
    x_dense = rng.normal(0.0, 1.0, (samples, dense)).astype(np.float32)
    logit += x_dense @ dense_w
    for a, b in pairs:  # fields a and b interact through their bags' mean hidden factors
        fa = factors[a][ids[:, a * bag:(a + 1) * bag]].mean(1)
        fb = factors[b][ids[:, b * bag:(b + 1) * bag]].mean(1)
        logit += (fa * fb).sum(1)
    p = 1.0 / (1.0 + np.exp(-logit))
    clicks = (rng.random(samples) < p).astype(np.float32)
    return {"sparse": ids, "dense": x_dense, "clicks": clicks, "p": p, "sizes": np.array(sizes)}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve by ranks (ties share their mean rank); 0.5 when one class is absent."""
    positives = labels > 0.5
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    start = 0
    for end in np.append(np.flatnonzero(np.diff(sorted_scores)) + 1, len(scores)):
        ranks[order[start:end]] = (start + end + 1) / 2.0  # ranks start..end-1, 1-based, averaged
        start = end
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _loss(model: nn.Module, batch) -> torch.Tensor:
    sparse, dense, clicks = batch
    return F.binary_cross_entropy_with_logits(model(sparse, dense), clicks)


@torch.no_grad()
def _evaluate(model: nn.Module, data: TensorDataset) -> dict:
    sparse, dense, clicks = data.tensors
    was_training = model.training
    model.eval()
    logits = model(sparse, dense).float().cpu()
    model.train(was_training)
    return {"auc": auc(logits.numpy(), clicks.numpy()),
            "log_loss": F.binary_cross_entropy_with_logits(logits, clicks).item()}


def ctr(samples: int = 200_000, fields: int = 8, vocab: int = 30, bag: int = 2, dense: int = 8, dim: int = 8,
        hidden: int = 64, seed: int = 0) -> Workload:
    """A CTR model on `samples` synthetic logs (the logs depend on `seed`, not on the job's seed)."""
    logs = click_logs(samples, fields, vocab, bag, dense, seed)
    cut = int(samples * 0.8)
    tensors = [torch.from_numpy(logs[k]) for k in ("sparse", "dense", "clicks")]
    model = CTRModel(tuple(int(s) for s in logs["sizes"]), bag, dense, dim, hidden)
    workload = Workload(model=model, train_data=TensorDataset(*(t[:cut] for t in tensors)),
                        eval_data=TensorDataset(*(t[cut:] for t in tensors)), loss=_loss, evaluate=_evaluate)
    held_out = slice(cut, samples)
    workload.best_auc = auc(logs["p"][held_out], logs["clicks"][held_out])  # type: ignore[attr-defined]
    workload.best_log_loss = float(-np.mean(  # type: ignore[attr-defined]
        logs["clicks"][held_out] * np.log(logs["p"][held_out]) + (1 - logs["clicks"][held_out]) * np.log(1 - logs["p"][held_out])))
    return workload
