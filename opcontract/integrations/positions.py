"""Where a token's position comes from, in training and in every generation step alike."""

from __future__ import annotations

import torch


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, L] mask (nonzero = real) -> [B, L] int64 positions: the count of real tokens before
    each real token in its row; -1 at padding."""
    m = mask.to(torch.bool)
    return torch.where(m, torch.cumsum(m.to(torch.int64), dim=1) - 1, -1)
