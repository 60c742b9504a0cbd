"""Index inputs that a contract declares ``host`` may come as CPU tensors while the call runs
on a GPU (dispatch then checked their values without waiting for the GPU). Implementations
bring them to the call's device with ``on_device`` where a kernel reads them, and may use the
host copy first for what the host decides (a tile table, a chunk count) without a sync."""

from __future__ import annotations

import torch


def on_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` on ``device``: a host tensor copied without waiting for the GPU's queue (the
    copy is ordered before any kernel launched after it on the current stream)."""
    if t is None or t.device == device:
        return t
    return t.to(device, non_blocking=True)
