"""Where a token's position comes from, in training and in every generation step alike."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, L] mask (nonzero = real) -> [B, L] int64 positions: the count of real tokens before
    each real token in its row; -1 at padding."""
    m = mask.to(torch.bool)
    return torch.where(m, torch.cumsum(m.to(torch.int64), dim=1) - 1, -1)


@dataclass(frozen=True)
class Packing:
    """Packed sequences in [B, L] rows (padding-free training): each row holds whole sequences
    back to back, each counting positions 0, 1, 2, ... ``positions`` [B * L] int64 on the
    model's device; ``cu_seqlens`` [S + 1] int64 on the host: sequence s is rows
    cu_seqlens[s] .. cu_seqlens[s + 1] - 1 of the B * L flattened tokens. ``index``: the
    attention's key table per device, built by the first layer, read by the others."""

    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    index: dict = field(default_factory=dict, compare=False, repr=False)


def packing_from_position_ids(position_ids: torch.Tensor, batch: int) -> Packing | None:
    """None when every row counts 0 .. L - 1 (one sequence a row); else the rows' sequences,
    each starting at position 0 and counting up by one (a ValueError naming position_ids
    otherwise). ``position_ids`` [B, L] or [1, L] (every row alike); one read-back."""
    ids = position_ids.expand(batch, position_ids.shape[-1])
    host = ids.detach().to("cpu", torch.int64)
    B, L = host.shape
    if bool((host == torch.arange(L)).all()):
        return None
    flat = host.reshape(-1)
    first = torch.arange(B) * L
    if not bool((flat[first] == 0).all()):
        rows = (flat[first] != 0).nonzero().flatten().tolist()
        raise ValueError(f"position_ids: rows {rows} of a packed batch do not start a sequence "
                         "at position 0")  # fmt: skip
    step = torch.ones_like(flat, dtype=torch.bool)
    step[1:] = (flat[1:] == 0) | (flat[1:] == flat[:-1] + 1)
    step[first] = True
    if not bool(step.all()):
        bad = int((~step).nonzero()[0])
        raise ValueError(
            f"position_ids: row {bad // L} column {bad % L} is {int(flat[bad])}; in a packed "
            "row each sequence counts 0, 1, 2, ... (a new one starts at 0)"
        )
    starts = (flat == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([B * L])])
    return Packing(ids.reshape(-1).to(torch.int64), cu)
