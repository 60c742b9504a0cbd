"""RMSNorm in plain torch: the float64 oracle and the strict path (which fused add +
RMSNorm and the normalized embedding reuse).

The strict path uses elementwise IEEE operations only: row sums are a fixed pairwise tree
over the row zero-padded to a power of two (``fixed_order.tree_sum``); the weight gradient
sums rows one at a time in blocks of ``DW_ROWS`` (the contract's dweight_t block), blocks
added in ascending order.
"""

from __future__ import annotations

import torch

from opcontract.backends.fixed_order import tree_sum
from opcontract.contracts import get_contract

DW_ROWS = get_contract("rms_norm").reductions["dweight_t"].block
VARIANTS = ("plain", "centred", "weightless")


def _scale64(weight, variant):
    if variant == "weightless":
        return None
    return weight.double() if variant == "plain" else 1.0 + weight.double()


def rms_norm_reference(x, weight=None, *, variant="plain", eps=1e-6):
    """Float64 oracle (differentiable)."""
    x64 = x.double()
    y = x64 * torch.rsqrt((x64 * x64).mean(dim=-1, keepdim=True) + eps)
    s = _scale64(weight, variant)
    return y if s is None else y * s


def _scale32(weight, variant):
    if variant == "weightless":
        return None
    return weight.float() if variant == "plain" else 1.0 + weight.float()


def strict_forward(x, weight, residual, variant, eps):
    """(y, residual_out | None, rstd): the contract's forward."""
    residual_out = None
    if residual is not None:
        residual_out = (x.float() + residual.float()).to(x.dtype)  # rounded once
        x = residual_out
    x32 = x.float()
    rstd = 1.0 / torch.sqrt(tree_sum(x32 * x32) / x.shape[-1] + eps)
    y = x32 * rstd[:, None]
    s = _scale32(weight, variant)
    if s is not None:
        y = y * s
    return y.to(x.dtype), residual_out, rstd


def strict_backward(dy, d_residual_out, x_in, weight, rstd, variant, dx_dtype=None):
    """(dx, dweight | None) where x_in is the normalised input (residual_out if fused);
    dx in ``dx_dtype`` (default: x_in's)."""
    T, H = x_in.shape
    xhat = x_in.float() * rstd[:, None]
    dy32 = dy.float()
    s = _scale32(weight, variant)
    g = dy32 if s is None else dy32 * s
    dx = rstd[:, None] * (g - xhat * (tree_sum(g * xhat) / H)[:, None])
    if d_residual_out is not None:
        dx = dx + d_residual_out.float()
    dw = None
    if s is not None:
        dw = torch.zeros(H, dtype=torch.float32, device=x_in.device)
        for b0 in range(0, T, DW_ROWS):  # dweight_t: blocks of rows, ascending
            part = torch.zeros(H, dtype=torch.float32, device=x_in.device)
            for t in range(b0, min(b0 + DW_ROWS, T)):
                part = part + dy32[t] * xhat[t]
            dw = dw + part
        dw = dw.to(weight.dtype)
    return dx.to(dx_dtype or x_in.dtype), dw


def forward(config, x, weight, *, variant, eps):
    """(y, rstd)."""
    y, _, rstd = strict_forward(x, weight, None, variant, eps)
    return y, rstd


def backward(config, saved, grads, needs, *, variant, eps):
    dx, dw = strict_backward(grads["y"], None, saved["x"], saved["weight"], saved["rstd"], variant)
    return {"x": dx, "weight": dw}
