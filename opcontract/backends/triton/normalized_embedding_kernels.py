"""Triton kernels of the normalized embedding: the gather fused with the weightless RMSNorm
(one program per token, the row's square sum a tl.sum tree fixed by BLOCK_H and num_warps),
and the table gradient.

The backward is one pass over the table: a program writes whole rows, zeros where no token
used the row, otherwise its tokens' float32 gradients (each with its row dot in the
forward's tree) summed in ascending token order. No atomics, no host sync.
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _embed_fwd_kernel(ids_ptr, table_ptr, y_ptr, raw_ptr, rstd_ptr, H, stride_t, eps,
                      RAW: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    v = tl.load(ids_ptr + row).to(tl.int64)
    x = tl.load(table_ptr + v * stride_t + cols, mask=mask, other=0.0)
    if RAW:
        tl.store(raw_ptr + row * H + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x32 * x32, axis=0) / H + eps))
    tl.store(y_ptr + row * H + cols, (x32 * rstd).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _embed_token_dx(t, x32, cols, mask, dy_ptr, draw_ptr, rstd_ptr, H,
                    HAS_DRAW: tl.constexpr):
    """Token t's gradient of the raw row x32, in float32: rstd * (dy - xhat * c) (+ d_raw),
    c = (sum_h dy * xhat) / H with the forward's row tree (BLOCK_H and num_warps)."""
    rstd = tl.load(rstd_ptr + t)
    dy = tl.load(dy_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
    xhat = x32 * rstd
    q = dy - xhat * (tl.sum(dy * xhat, axis=0) / H)
    if HAS_DRAW:
        # rstd * q + d_raw: one fma where Triton fuses (its default), rounded once; never
        # fused with the sum's add (its operand is an add)
        draw = tl.load(draw_ptr + t * H + cols, mask=mask, other=0.0)
        dx = rstd * q + draw.to(tl.float32)
    else:
        # the product as fma(rstd, q, +0): rounded on its own, so it can't be contracted
        # into the sum's add (acc + dx adds the token's rounded dx)
        dx = tl.math.fma(rstd, q, 0.0)
    return dx


@triton.jit
def _embed_bwd_kernel(dy_ptr, draw_ptr, order_ptr, ends_ptr, table_ptr, rstd_ptr, out_ptr, V, H,
                      stride_t, HAS_DRAW: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """dtable for ROWS table rows, whole rows: row v's tokens are order[ends[v-1]:ends[v]],
    ascending; their float32 gradients (_embed_token_dx) are summed from zero and rounded
    once. A row without tokens is written as zeros, its table values never read."""
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    for r in range(ROWS):
        v = tl.program_id(0).to(tl.int64) * ROWS + r
        if v < V:
            acc = tl.zeros((BLOCK_H,), tl.float32)
            start = tl.load(ends_ptr + v - 1, mask=v > 0, other=0)
            end = tl.load(ends_ptr + v)
            used = mask & ((cols.to(tl.int64) * 0 + end) > start)
            x32 = tl.load(table_ptr + v * stride_t + cols, mask=used, other=0.0).to(tl.float32)
            for i in range(start, end):
                t = tl.load(order_ptr + i).to(tl.int64)
                acc += _embed_token_dx(t, x32, cols, mask, dy_ptr, draw_ptr, rstd_ptr, H,
                                       HAS_DRAW)
            tl.store(out_ptr + v * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
