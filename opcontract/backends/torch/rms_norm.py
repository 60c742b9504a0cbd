"""RMSNorm and fused add + RMSNorm in plain torch: float64 oracles and the strict path.

The strict path uses elementwise IEEE operations only: row sums are a fixed pairwise tree
over the row zero-padded to a power of two; the weight gradient sums rows one at a time
in blocks of ``DW_ROWS``, blocks added in ascending order.
"""

from __future__ import annotations

import torch

DW_ROWS = 64
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


def fused_add_rms_norm_reference(x, residual, weight=None, *, variant="plain", eps=1e-6):
    from opcontract.outputs import AddNormOutput

    total = x.double() + residual.double()
    return AddNormOutput(rms_norm_reference(total, weight, variant=variant, eps=eps), total)


def normalized_embedding_reference(ids, table, *, eps=1e-5, return_raw=False):
    from opcontract.outputs import EmbeddingOutput

    raw = table.double()[ids.long()]
    y = rms_norm_reference(raw, variant="weightless", eps=eps)
    return EmbeddingOutput(y, raw) if return_raw else y


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed halving tree over zeros-padded 2**k entries."""
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size > n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], size - n)], dim=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


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


def embedding_forward(ids, table, eps, want_raw=True):
    """(y, raw, rstd); raw is [0, H] unless ``want_raw``."""
    raw = table[ids.long()]
    y, _, rstd = strict_forward(raw, None, None, "weightless", eps)
    return y, (raw if want_raw else raw[:0].clone()), rstd


def embedding_backward(dy, d_raw, ids, table, rstd):
    """dtable: token gradients in float32, summed per table row in ascending token order."""
    raw = table[ids.long()]
    dx, _ = strict_backward(dy, d_raw, raw, None, rstd, "weightless", dx_dtype=torch.float32)
    dtable = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    for t, v in enumerate(ids.long().tolist()):  # dtable_t: ascending tokens
        dtable[v] = dtable[v] + dx[t]
    return dtable.to(table.dtype)
