"""The normalized embedding in plain torch: the float64 oracle and the strict path (a gather,
the strict weightless RMSNorm, the table gradient summed token by token in ascending order)."""

from __future__ import annotations

import torch

from opcontract.backends.torch.rms_norm import rms_norm_reference, strict_backward, strict_forward


def normalized_embedding_reference(ids, table, *, eps=1e-5, return_raw=False):
    from opcontract.outputs import EmbeddingOutput

    raw = table.double()[ids.long()]
    y = rms_norm_reference(raw, variant="weightless", eps=eps)
    return EmbeddingOutput(y, raw) if return_raw else y


def strict_forward_raw(ids, table, eps, want_raw=True):
    """(y, raw, rstd); raw is [0, H] unless ``want_raw``."""
    raw = table[ids.long()]
    y, _, rstd = strict_forward(raw, None, None, "weightless", eps)
    return y, (raw if want_raw else raw[:0].clone()), rstd


def strict_backward_table(dy, d_raw, ids, table, rstd):
    """dtable: token gradients in float32, summed per table row in ascending token order."""
    raw = table[ids.long()]
    dx, _ = strict_backward(dy, d_raw, raw, None, rstd, "weightless", dx_dtype=torch.float32)
    dtable = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    for t, v in enumerate(ids.long().tolist()):  # dtable_t: ascending tokens
        dtable[v] = dtable[v] + dx[t]
    return dtable.to(table.dtype)


def forward(config, ids, table, *, eps, return_raw):
    """(y, raw or None, rstd)."""
    y, raw, rstd = strict_forward_raw(ids, table, eps, return_raw)
    return y, (raw if return_raw else None), rstd


def backward(config, saved, grads, needs, *, eps, return_raw):
    ids, table, rstd = saved["ids"], saved["table"], saved["rstd"]
    dy = grads["y"]
    if dy is None:
        dy = torch.zeros(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    d_raw = grads["raw"] if return_raw else None
    return {"table": strict_backward_table(dy, d_raw, ids, table, rstd)}
