"""Host code of the Triton RMSNorm kernels (plain, centred, weightless; the fused residual
add reuses them): shapes, buffers, grids."""

from __future__ import annotations

import torch

from opcontract.backends.torch.rms_norm import DW_ROWS
from opcontract.backends.triton.launch import launch, prepared

_VARIANT = {"plain": 0, "centred": 1, "weightless": 2}


def row_block(H: int) -> int:
    return max(16, 1 << max(H - 1, 0).bit_length())


def row_warps(block_h: int) -> int:
    """The forward's warps: with BLOCK_H they fix the row's reduction tree (row_square)."""
    return 4 if block_h <= 2048 else 8 if block_h <= 8192 else 16


# Forward: at decode sizes the weight loads with the row (H200, H = 6656, graph replay:
# T = 1 1.71 us, T = 64 2.02 us, against 1.86 and 2.15 loading it after the reduction);
# with many rows after the reduction (T = 8192 / 32768: 58.7 / 210.9 us against 62.4 /
# 227.7 us). benchmarks/results/memory_bound_ops_h200.json at 56ac9a0 and at 2402fb1.
W_FIRST_MAX_T = 64


def _bwd_stages(block_h: int, elem_bytes: int) -> int:
    """Rows of x and dy whose loads are in flight (shared memory) while one row computes.

    Loads only, never the order of an add. On the H200 at H = 6656, bf16, 4 stages ran the
    backward at 0.73-0.76 of copy against 0.52-0.54 for 2
    (benchmarks/results/norm_kernels_explore_h200.json as committed with ce7b455); capped at
    128 KiB of staging.
    """
    return max(1, min(4, (128 << 10) // (2 * block_h * elem_bytes)))


def _forward_launch(x, weight, residual, y, rout, out, variant, eps, store_rstd):
    """The forward's kernel, grid, runtime arguments and constexprs (x, residual contiguous;
    ``out``: the rstd buffer, or any pointer the kernel never writes without the store)."""
    from opcontract.backends.triton import rms_norm_kernels as k

    T, H = x.shape
    bh = row_block(H)
    w = weight if weight is not None else x
    scalars = (H, x.stride(0), float(eps))
    meta = dict(
        VARIANT=_VARIANT[variant],
        BLOCK_H=bh,
        W_FIRST=T <= W_FIRST_MAX_T,
        num_warps=row_warps(bh),
    )
    if not store_rstd:
        meta["STORE_RSTD"] = False
    if residual is None:
        return k._rms_fwd_kernel, (T,), (x, w, y, out, *scalars), meta
    return k._add_rms_fwd_kernel, (T,), (x, residual, w, y, rout, out, *scalars), meta


def norm_forward(x, weight, residual, variant, eps, store_rstd=True):
    """(y, residual_out | None, rstd | None); ``store_rstd=False`` (no backward to come):
    no rstd buffer, and the kernel skips its store (y's bits are the same)."""
    x = x.contiguous()
    T, H = x.shape
    y = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(T, dtype=torch.float32, device=x.device) if store_rstd else None
    if T:
        r = residual.contiguous() if residual is not None else None
        out = rstd if store_rstd else y  # a pointer the kernel never writes without the store
        kernel, grid, args, meta = _forward_launch(x, weight, r, y, rout, out, variant, eps,
                                                   store_rstd)  # fmt: skip
        launch(kernel, grid, *args, **meta)
    return y, rout, rstd


def norm_plan(x, weight, residual, variant, eps):
    """The call plan of a no-grad forward (see launch.prepared): a function of the caller's
    (x, weight) giving (y, None), or with a residual of (x, residual, weight) giving (y,
    residual_out); any leading dims. It returns None where it can't serve a call (an input
    not contiguous, or not aligned as compiled for)."""
    T, H = x.shape
    if not T or x.device.type != "cuda":
        return None
    y = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else None
    kernel, grid, args, meta = _forward_launch(x, weight, residual, y, rout, y, variant, eps,
                                               False)  # fmt: skip
    # alignment checked where the caller's tensors go (y and residual_out are fresh)
    go = prepared(kernel, grid, args, meta, checked=(0, 1) if residual is None else (0, 1, 2))
    if go is None:
        return None
    scalars = args[-3:]
    empty_like = torch.empty_like
    if residual is None:
        has_w = weight is not None

        def run_norm(x, weight):
            if not (x.is_contiguous() and (weight is None or weight.is_contiguous())):
                return None
            y = empty_like(x)
            xp, yp = x.data_ptr(), y.data_ptr()
            wp = weight.data_ptr() if has_w else xp
            return (y, None) if go(xp, wp, yp, yp, *scalars) else None

        return run_norm

    def run_add_norm(x, residual, weight):
        if not (x.is_contiguous() and residual.is_contiguous()):
            return None
        if weight is not None and not weight.is_contiguous():
            return None
        xp = x.data_ptr()
        wp = weight.data_ptr() if weight is not None else xp
        y, rout = empty_like(x), empty_like(x)
        yp = y.data_ptr()
        ok = go(xp, residual.data_ptr(), wp, yp, rout.data_ptr(), yp, *scalars)
        return (y, rout) if ok else None

    return run_add_norm


def norm_backward(dy, d_residual_out, x_in, weight, rstd, variant):
    """(dx, dweight | None)."""
    from opcontract.backends.triton import rms_norm_kernels as k

    T, H = x_in.shape
    dy = dy.contiguous()
    x_in = x_in.contiguous()
    dx = torch.empty_like(x_in)
    has_w = variant != "weightless"
    n_parts = -(-T // DW_ROWS)
    parts = torch.empty((max(n_parts, 1), H), dtype=torch.float32, device=x_in.device)
    dw = (torch.zeros_like(weight) if T == 0 else torch.empty_like(weight)) if has_w else None
    if T == 0:
        return dx, dw
    bh = row_block(H)
    launch(
        k._rms_bwd_kernel,
        (n_parts,),
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
        STAGES=_bwd_stages(bh, x_in.element_size()),
        num_warps=row_warps(bh),  # with BLOCK_H, row_dot's tree
    )
    if has_w:
        sum_partials(parts, n_parts, dw)
    return dx, dw


PARTIALS_BLOCK = 64  # columns per program: 104 programs at H = 6656
PARTIALS_UNROLL = 16  # partials whose loads are issued together


def sum_partials(parts: torch.Tensor, n_parts: int, out: torch.Tensor) -> None:
    """out[h] = (((0 + parts[0, h]) + parts[1, h]) + ...), rounded once to out's dtype: the
    GEMM's plane sum over n_parts planes of H, without bias."""
    from opcontract.backends.triton import dense_gemm_kernels as gk

    H = out.shape[0]
    launch(
        gk._add_partials_kernel, (-(-H // PARTIALS_BLOCK),),
        parts, out, parts, H, H, n_parts, H,
        BIAS=False, BLOCK=PARTIALS_BLOCK, UNROLL=PARTIALS_UNROLL, num_warps=2,
    )  # fmt: skip


def forward(config, x, weight, *, variant, eps):
    """(y, rstd)."""
    y, _, rstd = norm_forward(x, weight, None, variant, eps)
    return y, rstd


def forward_no_grad(config, x, weight, *, variant, eps):
    """(y, None): no backward will read rstd."""
    return norm_forward(x, weight, None, variant, eps, store_rstd=False)[0], None


def plan_no_grad(config, inputs, params, lead):
    """forward_no_grad's call plan: (y, None) from the caller's (x, weight)."""
    return norm_plan(inputs["x"], inputs["weight"], None, params["variant"], params["eps"])


def backward(config, saved, grads, needs, *, variant, eps):
    dx, dw = norm_backward(grads["y"], None, saved["x"], saved["weight"], saved["rstd"], variant)
    return {"x": dx, "weight": dw}
