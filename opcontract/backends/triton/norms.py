"""Host code of the Triton RMSNorm kernels: shapes, buffers, grids."""

from __future__ import annotations

import torch

from opcontract.backends.torch.norms import DW_ROWS

_VARIANT = {"plain": 0, "centred": 1, "weightless": 2}


def _block_h(H: int) -> int:
    return max(16, 1 << max(H - 1, 0).bit_length())


def _warps(block_h: int) -> int:
    return 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16


def forward(x, weight, residual, variant, eps):
    """(y, residual_out | None, rstd)."""
    from opcontract.backends.triton import norms_kernels as k

    x = x.contiguous()
    T, H = x.shape
    y = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    if T:
        bh = _block_h(H)
        k._rms_fwd_kernel[(T,)](
            x,
            residual.contiguous() if residual is not None else x,
            weight if weight is not None else x,
            y,
            rout if rout is not None else y,
            rstd,
            H,
            x.stride(0),
            float(eps),
            HAS_RES=residual is not None,
            VARIANT=_VARIANT[variant],
            BLOCK_H=bh,
            num_warps=_warps(bh),
        )
    return y, rout, rstd


def backward(dy, d_residual_out, x_in, weight, rstd, variant):
    """(dx, dweight | None)."""
    from opcontract.backends.triton import norms_kernels as k

    T, H = x_in.shape
    dy = dy.contiguous()
    x_in = x_in.contiguous()
    dx = torch.empty_like(x_in)
    has_w = variant != "weightless"
    n_parts = -(-T // DW_ROWS)
    parts = torch.empty((max(n_parts, 1), H), dtype=torch.float32, device=x_in.device)
    dw = torch.zeros_like(weight) if has_w else None
    if T == 0:
        return dx, dw
    bh = _block_h(H)
    k._rms_bwd_kernel[(n_parts,)](
        dy,
        d_residual_out.contiguous() if d_residual_out is not None else dy,
        x_in,
        weight if has_w else x_in,
        rstd,
        dx,
        parts,
        T,
        H,
        x_in.stride(0),
        HAS_DRES=d_residual_out is not None,
        VARIANT=_VARIANT[variant],
        ROWS=DW_ROWS,
        BLOCK_H=bh,
        num_warps=_warps(bh),
    )
    if has_w:
        block = 256
        k._sum_partials_kernel[(-(-H // block),)](parts, dw, n_parts, H, BLOCK=block)
    return dx, dw
