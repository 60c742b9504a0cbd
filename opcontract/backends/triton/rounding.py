"""Device functions for rounding: ``cast(x, dtype, INTERPRET)`` is ``x.to(dtype)``, rounding to
nearest-even as the GPU does, also under ``TRITON_INTERPRET=1``, whose float32 -> bfloat16
conversion truncates (it keeps bfloat16 as raw 16-bit words): there the rounding is done on
the bits."""

# fmt: off
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rne_bfloat16(x):
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, (b >> 16) | 0x40, r)  # a NaN stays a (quiet) NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (float32) rounded to dtype, to nearest-even."""
    if INTERPRET and dtype == tl.bfloat16:
        return _rne_bfloat16(x.to(tl.float32))
    else:
        return x.to(dtype)
