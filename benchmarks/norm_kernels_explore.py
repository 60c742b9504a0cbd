"""The Triton RMSNorm kernels' launch choices on one GPU, Muse Glimmer's H = 6656, bf16:
forward warps (they fix row_square's tree, so one count serves every T) and backward warps
and pipeline depth, timed at decode and training T; then, replayed from CUDA graphs (GPU time
alone), the backward's parts (row pass, weight-gradient partial sums, against the replaced
one-load-at-a-time sum) and the normalized embedding's backward (its sort, row search and
table pass, at several table rows per program). Reports which choices keep the shipped bits
(same tree) and which move them.

    python benchmarks/norm_kernels_explore.py --out results.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench, bench_graph, copy_gbps, env_stamp, write  # noqa: E402

from opcontract.backends.torch.rms_norm import DW_ROWS  # noqa: E402
from opcontract.backends.triton import LAUNCH  # noqa: E402
from opcontract.backends.triton import rms_norm as host  # noqa: E402
from opcontract.backends.triton import rms_norm_kernels as k  # noqa: E402

H = 6656


@triton.jit
def _rms_fwd_rsqrt_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, stride, eps, BLOCK_H: tl.constexpr):
    """Diagnostic only, never shipped: the shipped centred forward with the approximate
    rsqrt (what the contract forbids as fast math) in place of sqrt_rn and div_rn, to
    measure what the correctly rounded 1/sqrt costs a decode-sized call."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    s = 1.0 + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    tl.store(y_ptr + row * stride + cols, (x32 * rstd * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def _fwd_rsqrt(x, w):
    T = x.shape[0]
    y = torch.empty_like(x)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    _rms_fwd_rsqrt_kernel[(T,)](
        x, w, y, rstd, H, x.stride(0), 1e-5, BLOCK_H=host._block_h(H), num_warps=8, **LAUNCH
    )
    return y, rstd


def _fwd(x, w, res, warps, w_first=True):
    T = x.shape[0]
    y, rout = torch.empty_like(x), torch.empty_like(x) if res is not None else None
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    meta = dict(VARIANT=1, W_FIRST=w_first, BLOCK_H=host._block_h(H), num_warps=warps, **LAUNCH)
    if res is None:
        k._rms_fwd_kernel[(T,)](x, w, y, rstd, H, x.stride(0), 1e-5, **meta)
    else:
        k._add_rms_fwd_kernel[(T,)](x, res, w, y, rout, rstd, H, x.stride(0), 1e-5, **meta)
    return y, rstd


@triton.jit
def _sum_partials_loop_kernel(p_ptr, out_ptr, N_PARTS, H, BLOCK: tl.constexpr):
    """The replaced partial sum (for comparison): one partial's load at a time."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, N_PARTS, num_stages=4):
        acc += tl.load(p_ptr + i * H + cols, mask=mask, other=0.0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _bwd(dy, x, w, rstd, warps, stages, sum_parts=True):
    T = x.shape[0]
    dx = torch.empty_like(x)
    n_parts = -(-T // DW_ROWS)
    parts = torch.empty((n_parts, H), dtype=torch.float32, device=x.device)
    dw = torch.empty_like(w)
    k._rms_bwd_kernel[(n_parts,)](
        dy,
        dy,
        x,
        w,
        rstd,
        dx,
        parts,
        T,
        H,
        x.stride(0),
        HAS_DRES=False,
        VARIANT=1,
        ROWS=DW_ROWS,
        BLOCK_H=host._block_h(H),
        STAGES=stages,
        num_warps=warps,
        **LAUNCH,
    )
    if sum_parts:
        host.sum_partials(parts, n_parts, dw)
    return dx, dw, parts


def _graph_row(rows, name, T, fn, rep_ms, nbytes, gbps, **extra):
    ms = bench_graph(fn, rep_ms)
    rows.append({"pass": name, "T": T, "ms": ms, "graph": True, **extra})
    if nbytes:
        rows[-1]["fraction_of_copy"] = nbytes / ms / 1e6 / gbps
    print(rows[-1], flush=True)


def _backward_parts(rows, T, x, w, dy, rstd, gbps, rep_ms):
    """The shipped backward replayed from a graph: whole, row pass alone, partial sums
    alone (shipped and the replaced loop), with bits compared."""
    e = x.element_size()
    n_parts = -(-T // DW_ROWS)
    dx, dw, parts = _bwd(dy, x, w, rstd, 8, host._bwd_stages(host._block_h(H), e))
    loop_dw = torch.empty_like(dw)
    grid = (-(-H // 64),)
    _sum_partials_loop_kernel[grid](parts, loop_dw, n_parts, H, BLOCK=64, **LAUNCH)
    whole = host.norm_backward(dy, None, x, w, rstd, "centred")
    same = bool(torch.equal(whole[0], dx) and torch.equal(whole[1], dw))
    _graph_row(
        rows,
        "backward.whole",
        T,
        lambda: host.norm_backward(dy, None, x, w, rstd, "centred"),
        rep_ms,
        3 * T * H * e,
        gbps,
        kernel="centred",
        bits_equal_to_parts=same,
    )
    stages = host._bwd_stages(host._block_h(H), e)
    _graph_row(
        rows,
        "backward.row_pass",
        T,
        lambda: _bwd(dy, x, w, rstd, 8, stages, sum_parts=False),
        rep_ms,
        3 * T * H * e,
        gbps,
        kernel="centred",
    )
    _graph_row(
        rows,
        "backward.sum_partials",
        T,
        lambda: host.sum_partials(parts, n_parts, dw),
        rep_ms,
        4 * n_parts * H,
        gbps,
        unroll=host.PARTIALS_UNROLL,
    )
    _graph_row(
        rows,
        "backward.sum_partials (replaced loop)",
        T,
        lambda: _sum_partials_loop_kernel[grid](parts, loop_dw, n_parts, H, BLOCK=64, **LAUNCH),
        rep_ms,
        4 * n_parts * H,
        gbps,
        bits_equal_to_shipped=bool(torch.equal(loop_dw, dw)),
    )


def _embedding_parts(rows, T, gbps, rep_ms, V=202048):
    """The embedding backward replayed from a graph: whole at several rows per program
    (bits compared), and its sort, row search and table pass alone."""
    g = torch.Generator(device="cuda").manual_seed(T)
    table = torch.randn(V, H, device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, V, (T,), device="cuda", generator=g)
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    _, _, rstd = host.embedding_forward(ids, table, 1e-5, False)
    e = table.element_size()
    nbytes = V * H * e + 2 * T * H * e  # the table written; dy and each token's row read
    shipped = host.EMBED_ROWS
    first = None
    for rows_per in (8, 16, 32):
        host.EMBED_ROWS = rows_per
        out = host.embedding_backward(dy, None, ids, table, rstd)
        first = out if first is None else first
        _graph_row(
            rows,
            "embedding_backward.whole",
            T,
            lambda: host.embedding_backward(dy, None, ids, table, rstd),
            rep_ms,
            nbytes,
            gbps,
            rows_per_program=rows_per,
            bits_equal_to_first=bool(torch.equal(out, first)),
        )
    host.EMBED_ROWS = shipped
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    r = torch.arange(V, device="cuda")
    _graph_row(
        rows,
        "embedding_backward.argsort",
        T,
        lambda: torch.argsort(ids, stable=True),
        rep_ms,
        0,
        gbps,
    )
    _graph_row(
        rows,
        "embedding_backward.argsort_int32",
        T,
        lambda: torch.argsort(ids.int(), stable=True),
        rep_ms,
        0,
        gbps,
    )
    _graph_row(
        rows,
        "embedding_backward.searchsorted",
        T,
        lambda: torch.searchsorted(sorted_ids, r, right=True),
        rep_ms,
        0,
        gbps,
    )
    _graph_row(
        rows,
        "embedding_backward.zeros (memset of the table)",
        T,
        lambda: torch.zeros_like(table),
        rep_ms,
        V * H * e,
        gbps,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=float, default=60)
    args = ap.parse_args()
    gbps = copy_gbps()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in (1, 64, 8192, 32768):
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        r = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w = (torch.randn(H, device="cuda", generator=g) * 0.1).bfloat16()
        dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        e = x.element_size()
        ref = {}
        for res_name, res in (("plain", None), ("fused_add", r)):
            for warps, w_first in ((4, True), (8, True), (8, False), (16, True), (32, True)):
                y, rstd = _fwd(x, w, res, warps, w_first)
                ref.setdefault(res_name, y)
                f = lambda: _fwd(x, w, res, warps, w_first)  # noqa: E731, B023
                ms = bench_graph(f, args.rep_ms) if T <= 64 else bench(f, rep_ms=args.rep_ms)[0]
                nbytes = (2 + 2 * (res is not None)) * T * H * e
                rows.append(
                    {
                        "pass": "forward",
                        "kernel": res_name,
                        "T": T,
                        "num_warps": warps,
                        "weight_load": "with the row" if w_first else "after the reduction",
                        "ms": ms,
                        "graph": T <= 64,
                        "fraction_of_copy": nbytes / ms / 1e6 / gbps,
                        "bits_equal_to_first": bool(torch.equal(y, ref[res_name])),
                    }
                )
                print(rows[-1], flush=True)
        approx = lambda x=x, w=w: _fwd_rsqrt(x, w)  # noqa: E731
        ms = bench_graph(approx, args.rep_ms) if T <= 64 else bench(approx, rep_ms=args.rep_ms)[0]
        rows.append(
            {
                "pass": "forward",
                "kernel": "centred.approx_rsqrt (diagnostic)",
                "T": T,
                "num_warps": 8,
                "ms": ms,
                "graph": T <= 64,
            }
        )
        print(rows[-1], flush=True)
        if T < 8192:
            continue
        _, rstd = _fwd(x, w, None, 8)
        ref_b = None
        for warps, stages in [(wp, st) for wp in (8, 16) for st in (3, 4)]:
            try:
                dx, dw, _ = _bwd(dy, x, w, rstd, warps, stages)
                ms = bench(
                    lambda: _bwd(dy, x, w, rstd, warps, stages),  # noqa: B023
                    rep_ms=args.rep_ms,
                )[0]
            except Exception as exc:  # e.g. out of shared memory or registers
                rows.append(
                    {"pass": "backward", "T": T, "num_warps": warps, "stages": stages,
                     "error": repr(exc)[:200]}
                )  # fmt: skip
                continue
            ref_b = ref_b or (dx, dw)
            nbytes = 3 * T * H * e
            rows.append(
                {
                    "pass": "backward",
                    "kernel": "centred",
                    "T": T,
                    "num_warps": warps,
                    "stages": stages,
                    "ms": ms,
                    "fraction_of_copy": nbytes / ms / 1e6 / gbps,
                    "dx_bits_equal_to_first": bool(torch.equal(dx, ref_b[0])),
                    "dw_bits_equal_to_first": bool(torch.equal(dw, ref_b[1])),
                }
            )
            print(rows[-1], flush=True)
        _backward_parts(rows, T, x, w, dy, rstd, gbps, args.rep_ms)
        try:
            _embedding_parts(rows, T, gbps, args.rep_ms)
        except Exception as exc:  # recorded; the rows so far are still written
            rows.append({"pass": "embedding_backward", "T": T, "error": repr(exc)[:300]})
            break
    write(
        args.out,
        {
            "benchmark": "norm_kernels_explore",
            "env": env_stamp(),
            "ceilings": {"copy_gbps": gbps},
            "H": H,
            "dtype": "bfloat16",
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
