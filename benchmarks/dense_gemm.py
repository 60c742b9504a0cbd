"""dense_gemm on Muse Glimmer's projection shapes: batch invariance and throughput.

    python benchmarks/dense_gemm.py --out results.json
    python benchmarks/dense_gemm.py --smoke --out /tmp/smoke.json   # CPU, tiny shapes

Invariance: rows computed at M in {1, 2, 3, 8, 16, 31, 64, 100, 128, 1000, 4096} against
the same rows inside M = 8192, for opcontract (forward and dx), cuBLAS (F.linear, the
non-invariant ceiling) and, when importable, batch_invariant_ops' persistent Triton matmul
(forward only: it has no backward). Throughput: TFLOP/s (2·M·N·K over the median); at
M <= --graph-max-m also from CUDA-graph replay (mode "forward.graph": no host time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_graph, env_stamp, write  # noqa: E402

from opcontract import dispatch  # noqa: E402

SHAPES = {  # name: (N, K)
    "qkv_gate": (4096 + 256 + 256 + 4096, 6656),
    "o_proj": (6656, 4096),
    "gate_up": (2 * 19968, 6656),
    "down_proj": (6656, 19968),
}
INVARIANCE_M = [1, 2, 3, 8, 16, 31, 64, 100, 128, 1000, 4096]
THROUGHPUT_M = [1, 16, 64, 256, 1024, 4096, 16384]


def _time(fn, cuda: bool) -> float:
    if cuda:
        from common import bench

        return bench(fn, rep_ms=200)[0]
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--graph-max-m", type=int, default=256, help="also time CUDA-graph replay")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cuda = not args.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = SHAPES if cuda else {"tiny": (48, 80)}
    m_full, inv_m, thr_m = (8192, INVARIANCE_M, THROUGHPUT_M) if cuda else (40, [1, 3, 17], [8])
    providers = {
        "opcontract": dispatch.op("dense_gemm"),
        "cublas": dispatch.op("dense_gemm", backend="torch.cublas", mode="relaxed"),
    }
    forward_only = set()
    if cuda:
        try:  # the published batch-invariant peer, if it is on the path
            from batch_invariant_ops import matmul_persistent

            providers["batch_invariant_ops"] = lambda x, w: matmul_persistent(x, w.t())
            forward_only.add("batch_invariant_ops")
        except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
            print("batch_invariant_ops unavailable:", repr(exc)[:200])
    invariance, rows = [], []
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(m_full, K, device=dev, generator=g).to(dtype)
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(dtype)
        dy = torch.randn(m_full, N, device=dev, generator=g).to(dtype)
        for prov, op in providers.items():

            def fwd_dx(rows_x, rows_dy, op=op, w=w, grad=prov not in forward_only):
                if not grad:
                    with torch.no_grad():
                        return op(rows_x, w), None
                xs = rows_x.detach().requires_grad_()
                y = op(xs, w)
                y.backward(rows_dy)
                return y.detach(), xs.grad

            full_y, full_dx = fwd_dx(x, dy)
            for M in inv_m:
                y, dx = fwd_dx(x[:M], dy[:M])
                invariance.append(
                    {
                        "shape": name,
                        "provider": prov,
                        "M": M,
                        "forward_equal": bool(torch.equal(y, full_y[:M])),
                        "dx_equal": None if dx is None else bool(torch.equal(dx, full_dx[:M])),
                    }
                )
            print(
                name,
                prov,
                "forward-invariant M:",
                [r["M"] for r in invariance[-len(inv_m) :] if r["forward_equal"]],
                flush=True,
            )
            for M in thr_m:
                xm = torch.randn(M, K, device=dev, generator=g).to(dtype)
                timed = []
                with torch.no_grad():
                    timed.append(("forward", _time(lambda op=op, xm=xm, w=w: op(xm, w), cuda)))
                    if cuda and M <= args.graph_max_m:  # the kernel alone, no host time
                        g_ms = bench_graph(lambda op=op, xm=xm, w=w: op(xm, w))
                        timed.append(("forward.graph", g_ms))
                served = None
                if prov == "opcontract":  # which implementation and config dispatch chose
                    with torch.no_grad():
                        op(xm, w)
                    p = dispatch.last_provenance()
                    served = {"implementation": p.implementation, "config": p.config}
                for mode, ms in timed:
                    rows.append(
                        {
                            "kernel": f"dense_gemm.{name}",
                            "provider": prov,
                            "served_by": served,
                            "mode": mode,
                            "metric": "time",
                            "x_name": "M",
                            "x": M,
                            "median": ms,
                            "unit": "ms",
                            "tflops": 2 * M * N * K / ms / 1e9,
                        }
                    )
                    print(
                        f"{name:10s} {prov:10s} M={M:6d} {mode:13s} {ms:8.3f} ms "
                        f"{rows[-1]['tflops']:7.1f} TFLOP/s",
                        flush=True,
                    )
    write(
        args.out,
        {
            "benchmark": "dense_gemm",
            "env": env_stamp(),
            "dtype": str(dtype),
            "invariance": invariance,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
