"""RMSNorm forward at decode sizes (T = 1, 64; H = 6656, bf16) on one GPU: the shipped
kernel against variants that keep its bits, and Liger's RMSNorm, replayed from CUDA graphs.

    python benchmarks/rms_decode_explore.py --out results.json

Variants: the reciprocal of the square root as PTX's correctly rounded reciprocal
(``rcp.rn.f32``, the same value as the shipped ``div_rn(1, s)`` by IEEE 754), and the
forward without its rstd store (what a call that needs no backward could run); and the
shipped kernel launched without its host wrapper. Every provider is timed in ``--rounds``
interleaved rounds, each starting one provider later; the row keeps each round's median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_graph, env_stamp, write  # noqa: E402

from opcontract.backends.triton import LAUNCH  # noqa: E402
from opcontract.backends.triton import rms_norm as host  # noqa: E402

H = 6656


@triton.jit
def _rcp_rn(x):
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _rms_fwd_variant_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, stride, eps,
                            VARIANT: tl.constexpr, BLOCK_H: tl.constexpr, RCP: tl.constexpr,
                            STORE_RSTD: tl.constexpr):  # fmt: skip
    # the shipped forward without residual, weight loaded with the row (T <= 64)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    s = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 1:
        s = 1.0 + s
    x32 = x.to(tl.float32)
    root = tl.sqrt_rn(tl.sum(x32 * x32, axis=0) / H + eps)
    if RCP:
        rstd = _rcp_rn(root)
    else:
        rstd = tl.math.div_rn(1.0, root)
    y = x32 * rstd * s
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)


def _variant(x, w, centred, rcp, store):
    T = x.shape[0]
    y = torch.empty_like(x)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    bh = host._block_h(H)
    _rms_fwd_variant_kernel[(T,)](
        x, w, y, rstd, H, x.stride(0), 1e-5, VARIANT=int(centred), BLOCK_H=bh, RCP=rcp,
        STORE_RSTD=store, num_warps=host._warps(bh), **LAUNCH,
    )  # fmt: skip
    return y


def _shipped(x, w, variant):
    """The shipped kernel through Triton's JIT, without the host wrapper."""
    from opcontract.backends.triton import rms_norm_kernels as k

    T = x.shape[0]
    y = torch.empty_like(x)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    bh = host._block_h(H)
    k._rms_fwd_kernel[(T,)](
        x, w, y, rstd, H, x.stride(0), 1e-5, VARIANT=host._VARIANT[variant], BLOCK_H=bh,
        W_FIRST=True, num_warps=host._warps(bh), **LAUNCH,
    )  # fmt: skip
    return y


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=float, default=40)
    args = ap.parse_args()
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        print("liger unavailable:", repr(exc)[:200])
        LigerRMSNorm = None
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.no_grad():
        for centred in (False, True):
            w = (torch.randn(H, device="cuda", generator=g) * 0.1).bfloat16()
            liger = None
            if LigerRMSNorm is not None:
                liger = LigerRMSNorm(H, eps=1e-5, offset=float(centred), casting_mode="gemma")
                liger = liger.to("cuda", torch.bfloat16)
                liger.weight.copy_(w)
            for T in (1, 64):
                x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
                variant = "centred" if centred else "plain"
                shipped = host.norm_forward(x, w, None, variant, 1e-5)[0]
                fns = {
                    "shipped": lambda x=x, w=w, v=variant: host.norm_forward(x, w, None, v, 1e-5),
                    "shipped kernel, launched directly": lambda x=x, w=w, v=variant: _shipped(
                        x, w, v
                    ),
                    "same kernel, rcp.rn": lambda x=x, w=w, c=centred: _variant(
                        x, w, c, True, True
                    ),
                    "same kernel, div_rn": lambda x=x, w=w, c=centred: _variant(
                        x, w, c, False, True
                    ),
                    "rcp.rn, no rstd store": lambda x=x, w=w, c=centred: _variant(
                        x, w, c, True, False
                    ),
                }
                if liger is not None:
                    fns["liger"] = lambda x=x, m=liger: m(x)
                times = {name: [] for name in fns}
                names = list(fns)
                for i in range(args.rounds):  # each round starts one provider later
                    for name in names[i % len(names) :] + names[: i % len(names)]:
                        times[name].append(bench_graph(fns[name], args.rep_ms) * 1e3)
                for name, fn in fns.items():
                    out = fn()
                    out = out[0] if isinstance(out, tuple) else out
                    row = {
                        "variant": variant,
                        "T": T,
                        "provider": name,
                        "us_median_of_rounds": statistics.median(times[name]),
                        "us_rounds": times[name],
                        "bits_equal_to_shipped": bool(torch.equal(out, shipped)),
                    }
                    rows.append(row)
                    print(row, flush=True)
    write(args.out, {"benchmark": "rms_decode_explore", "env": env_stamp(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
