"""Placeholder until the batched kernel lands: the PyTorch reference only."""

from __future__ import annotations

import torch


def lora_shrink_expand(x, y, slot, a, b, rank, scale) -> None:
    for s in torch.unique(slot).tolist():
        if s < 0 or int(rank[s]) == 0:
            continue
        rows = (slot == s).nonzero().squeeze(1)
        r = int(rank[s])
        delta = (x[rows] @ a[s, :r].T) @ b[s, :, :r].T
        y.index_add_(0, rows, delta * float(scale[s]))
