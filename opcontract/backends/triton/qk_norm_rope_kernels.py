"""Triton kernels of qk_norm_rope: one program per (token, head), q heads first, then k.

A head's D channels load as two halves (the rotation pairs channel i with i + D/2); its
square sum is tl.sum over each half, the two sums added: one fixed tree, the same for every
head, token and batch size. The angle p * theta^(-2i/D) is one float64 multiply of the
host's float64 frequencies; cos and sin are evaluated in float64 and rounded once. The
rotation's products and sums are float32 (a product and the add after it may contract into
one fma: the pinned fp-fusion option decides, as everywhere).
"""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _trig(pos_ptr, freq_ptr, tok, cols, HALF: tl.constexpr):
    p = tl.load(pos_ptr + tok).to(tl.float64)
    f = tl.load(freq_ptr + cols, mask=cols < HALF, other=0.0)
    a = p * f
    return tl.cos(a).to(tl.float32), tl.sin(a).to(tl.float32)


@triton.jit
def _qk_fwd_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, rq_ptr, rk_ptr, pos_ptr, freq_ptr, Hq, Hkv,
                   qk_scale, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < Hq:
        row = tok * Hq + head
        x_ptr, o_ptr, r_ptr = q_ptr, qo_ptr, rq_ptr
    else:
        row = tok * Hkv + (head - Hq)
        x_ptr, o_ptr, r_ptr = k_ptr, ko_ptr, rk_ptr
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = row * (2 * HALF)
    lo = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    ms = (tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    lo = lo * rstd
    hi = hi * rstd
    if head < Hq:
        lo = lo * qk_scale
        hi = hi * qk_scale
    if ROPE:
        c, s = _trig(pos_ptr, freq_ptr, tok, cols, HALF)
        lo, hi = lo * c - hi * s, hi * c + lo * s
    tl.store(o_ptr + base + cols, lo.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + base + HALF + cols, hi.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + row, rstd)


@triton.jit
def _qk_bwd_kernel(q_ptr, k_ptr, dqo_ptr, dko_ptr, rq_ptr, rk_ptr, dq_ptr, dk_ptr, pos_ptr,
                   freq_ptr, Hq, Hkv, qk_scale, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   ROPE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < Hq:
        row = tok * Hq + head
        x_ptr, g_ptr, r_ptr, d_ptr = q_ptr, dqo_ptr, rq_ptr, dq_ptr
    else:
        row = tok * Hkv + (head - Hq)
        x_ptr, g_ptr, r_ptr, d_ptr = k_ptr, dko_ptr, rk_ptr, dk_ptr
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = row * (2 * HALF)
    glo = tl.load(g_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    ghi = tl.load(g_ptr + base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        c, s = _trig(pos_ptr, freq_ptr, tok, cols, HALF)
        glo, ghi = glo * c + ghi * s, ghi * c - glo * s
    if head < Hq:
        glo = glo * qk_scale
        ghi = ghi * qk_scale
    rstd = tl.load(r_ptr + row)
    xlo = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32) * rstd
    xhi = tl.load(x_ptr + base + HALF + cols, mask=mask, other=0.0).to(tl.float32) * rstd
    dot = (tl.sum(glo * xlo, axis=0) + tl.sum(ghi * xhi, axis=0)) / (2 * HALF)
    dlo = rstd * (glo - xlo * dot)
    dhi = rstd * (ghi - xhi * dot)
    tl.store(d_ptr + base + cols, dlo.to(d_ptr.dtype.element_ty), mask=mask)
    tl.store(d_ptr + base + HALF + cols, dhi.to(d_ptr.dtype.element_ty), mask=mask)
