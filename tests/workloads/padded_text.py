"""Padded token rows as Hugging Face gives them (`data:` of orchestrator.workloads.hf:causal_lm): each
sample a dict of `input_ids`, `attention_mask` and `labels` (-100 on the padding), of 3 to 16 real tokens
drawn with a fixed seed and padded to 16, so that members' shares hold different numbers of loss tokens."""
from __future__ import annotations

import torch

WIDTH, VOCAB = 16, 256


class Padded(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, WIDTH + 1, (n,), generator=g)
        self.ids = torch.randint(1, VOCAB, (n, WIDTH), generator=g)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(WIDTH) < self.lengths[i]).long()
        ids = self.ids[i] * mask
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make() -> tuple[Padded, Padded]:
    return Padded(600, 1), Padded(40, 2)
