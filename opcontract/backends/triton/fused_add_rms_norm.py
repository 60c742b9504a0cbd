"""Host code of the Triton fused residual add + RMSNorm: the sum rounded once, then the
RMSNorm kernels (the add-norm forward kernel, the shared backward)."""

from __future__ import annotations

import torch

from opcontract.backends.triton.rms_norm import norm_backward, norm_forward, norm_plan


def forward(config, x, residual, weight, *, variant, eps):
    """(y, residual_out, rstd)."""
    return norm_forward(x, weight, residual, variant, eps)


def forward_no_grad(config, x, residual, weight, *, variant, eps):
    """(y, residual_out, None): no backward will read rstd."""
    return norm_forward(x, weight, residual, variant, eps, store_rstd=False)


def plan_no_grad(config, inputs, params, lead):
    """forward_no_grad's call plan: (y, residual_out) from the caller's (x, residual,
    weight)."""
    return norm_plan(inputs["x"], inputs["weight"], inputs["residual"], params["variant"],
                     params["eps"])  # fmt: skip


def backward(config, saved, grads, needs, *, variant, eps):
    """The residual's gradient is x's: both enter the sum alike."""
    rout = saved["residual_out"]
    dy = grads["y"] if grads["y"] is not None else torch.zeros_like(rout)
    dres = grads["residual_out"]
    if dres is not None and not dres.numel():
        dres = None
    dx, dw = norm_backward(dy, dres, rout, saved["weight"], saved["rstd"], variant)
    return {"x": dx, "residual": dx, "weight": dw}
