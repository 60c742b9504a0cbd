"""Fused residual add + RMSNorm in plain torch: the float64 oracle and the strict path (the
float32 sum rounded once to the input dtype, then the strict RMSNorm of it)."""

from __future__ import annotations

import torch

from opcontract.backends.torch.rms_norm import rms_norm_reference, strict_backward, strict_forward


def fused_add_rms_norm_reference(x, residual, weight=None, *, variant="plain", eps=1e-6):
    from opcontract.outputs import AddNormOutput

    total = x.double() + residual.double()
    return AddNormOutput(rms_norm_reference(total, weight, variant=variant, eps=eps), total)


def forward(config, x, residual, weight, *, variant, eps):
    """(y, residual_out, rstd)."""
    return strict_forward(x, weight, residual, variant, eps)


def backward(config, saved, grads, needs, *, variant, eps):
    """The residual's gradient is x's: both enter the sum alike."""
    rout = saved["residual_out"]
    dy = grads["y"] if grads["y"] is not None else torch.zeros_like(rout)
    dres = grads["residual_out"]
    if dres is not None and not dres.numel():
        dres = None
    dx, dw = strict_backward(dy, dres, rout, saved["weight"], saved["rstd"], variant)
    return {"x": dx, "residual": dx, "weight": dw}
