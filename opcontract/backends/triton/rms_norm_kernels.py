"""Triton kernels of RMSNorm (optionally fused with the residual add), forward and backward.

One program normalises one row: the row's square sum is a tl.sum tree fixed by BLOCK_H and
num_warps, the same for every row. The backward's program walks DW_ROWS rows in ascending
order, writing each row's dx and summing its weight-gradient partial in float32; the GEMM's
plane sum (dense_gemm_kernels._add_partials_kernel) then adds the partials in ascending
order. No atomics.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scale(w_ptr, cols, mask, VARIANT: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 1:  # centred: x·rstd·(1 + w)
        w = 1.0 + w
    return w


@triton.jit
def _load_row(x_ptr, w_ptr, H, stride, VARIANT: tl.constexpr, BLOCK_H: tl.constexpr,
              W_FIRST: tl.constexpr):
    # (row, cols, mask, x, s): this program's row, and the scale if W_FIRST loads it with x
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    if VARIANT < 2 and W_FIRST:
        s = _scale(w_ptr, cols, mask, VARIANT)
    else:
        s = 0.0
    return row, cols, mask, x, s


@triton.jit
def _normalize_store(x, s, w_ptr, y_ptr, rstd_ptr, row, stride, cols, mask, H, eps,
                     VARIANT: tl.constexpr, W_FIRST: tl.constexpr, STORE_RSTD: tl.constexpr):
    # y = x·rstd·scale from the row in its final dtype; s is the scale when W_FIRST loaded it
    x32 = x.to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x32 * x32, axis=0) / H + eps))
    y = x32 * rstd
    if VARIANT < 2:
        if not W_FIRST:
            s = _scale(w_ptr, cols, mask, VARIANT)
        y = y * s
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:  # for the backward; a call that builds no autograd graph has none
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, stride, eps, VARIANT: tl.constexpr,
                    BLOCK_H: tl.constexpr, W_FIRST: tl.constexpr, STORE_RSTD: tl.constexpr = True):
    # W_FIRST moves the weight's load, never an operation: with x's load (one memory round
    # trip, for decode-sized calls) or after the reduction (fewer live registers, for many
    # rows). A kernel of its own rather than _add_rms_fwd_kernel without the residual: the
    # same bits, and 2.5% faster at T = 64 on the H200 (rms_decode_explore_h200.json).
    row, cols, mask, x, s = _load_row(x_ptr, w_ptr, H, stride, VARIANT, BLOCK_H, W_FIRST)
    _normalize_store(x, s, w_ptr, y_ptr, rstd_ptr, row, stride, cols, mask, H, eps, VARIANT,
                     W_FIRST, STORE_RSTD)


@triton.jit
def _add_rms_fwd_kernel(x_ptr, r_ptr, w_ptr, y_ptr, rout_ptr, rstd_ptr, H, stride, eps,
                        VARIANT: tl.constexpr, BLOCK_H: tl.constexpr, W_FIRST: tl.constexpr,
                        STORE_RSTD: tl.constexpr = True):
    # the residual sum in float32, rounded once to the input dtype, then as _rms_fwd_kernel
    row, cols, mask, x, s = _load_row(x_ptr, w_ptr, H, stride, VARIANT, BLOCK_H, W_FIRST)
    r = tl.load(r_ptr + row * stride + cols, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(rout_ptr + row * stride + cols, x, mask=mask)
    _normalize_store(x, s, w_ptr, y_ptr, rstd_ptr, row, stride, cols, mask, H, eps, VARIANT,
                     W_FIRST, STORE_RSTD)


@triton.jit
def _rms_bwd_kernel(dy_ptr, dres_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dwp_ptr, T, H, stride,
                    HAS_DRES: tl.constexpr, VARIANT: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_H: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    if VARIANT < 2:
        s = _scale(w_ptr, cols, mask, VARIANT)
    dw = tl.zeros((BLOCK_H,), tl.float32)
    # dweight_t: this block's rows in ascending order; the next row's loads are issued while
    # this one computes (pipelining moves loads, never the order of the adds)
    for i in tl.range(ROWS, num_stages=STAGES):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        m = mask & ((cols.to(tl.int64) * 0 + row) < T)
        x32 = tl.load(x_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, T - 1))  # rows past T: masked below
        xhat = x32 * rstd
        g = dy
        if VARIANT < 2:
            g = dy * s
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / H))
        if HAS_DRES:
            dx += tl.load(dres_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
        if VARIANT < 2:
            dw += dy * xhat
    if VARIANT < 2:
        tl.store(dwp_ptr + tl.program_id(0).to(tl.int64) * H + cols, dw, mask=mask)
