"""Host cost per call of each layer of an opcontract call, at decode sizes on one GPU.

    python benchmarks/host_overhead.py --out results.json

For rms_norm, swiglu and dense_gemm at T = 1: the wall time per call of a loop of calls
(synchronised once at the end), peeling the layers off one by one: dispatch.op(...),
the torch.library op, the Triton host wrapper; torch eager and torch.compile of the eager
code beside them; and the CUDA-graph replay of the dispatch call (the GPU time alone).
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
from opcontract.dispatch import call_cache  # noqa: E402
from opcontract.dispatch.shell import op_shell  # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_us(fn) -> float | None:
    try:
        return bench_graph(fn, rep_ms=50) * 1e3
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        print("graph capture failed:", repr(exc)[:150])
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from opcontract.backends.triton import dense_gemm as tg
    from opcontract.backends.triton import rms_norm as tn
    from opcontract.backends.triton import swiglu as ts

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, 6656, device=dev, dtype=dt)
    w = torch.randn(6656, device=dev, dtype=dt)
    g, u = torch.randn(1, 19968, device=dev, dtype=dt), torch.randn(1, 19968, device=dev, dtype=dt)
    xo = torch.randn(1, 4096, device=dev, dtype=dt)
    wo = torch.randn(6656, 4096, device=dev, dtype=dt) / 64

    def eager_norm(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + 1e-5) * w.float()).to(
            x.dtype
        )

    def eager_swiglu(g, u):
        return (torch.nn.functional.silu(g.float()) * u.float()).to(g.dtype)

    rms, sw, gemm = dispatch.op("rms_norm"), dispatch.op("swiglu"), dispatch.op("dense_gemm")
    cfg = dispatch.explain("dense_gemm", xo, wo).config
    cn, cs = torch.compile(eager_norm), torch.compile(eager_swiglu)
    layers = {
        "rms_norm": {
            "dispatch": lambda: rms(x, w, eps=1e-5),
            "dispatch.host_side_only": lambda: call_cache.get(
                call_cache.key(rms._route, (x, w), {"eps": 1e-5})
            ),
            "torch.library op": lambda: op_shell("rms_norm").call_forward(
                {"x": x, "weight": w}, {"variant": "plain", "eps": 1e-5}, "triton", "strict", ""
            ),
            "triton host wrapper": lambda: tn.norm_forward(x, w, None, "plain", 1e-5),
            "eager": lambda: eager_norm(x, w),
            "torch.compile": lambda: cn(x, w),
        },
        "swiglu": {
            "dispatch": lambda: sw(g, u),
            "torch.library op": lambda: op_shell("swiglu").call_forward(
                {"gate": g, "up": u}, {"layout": "separate"}, "triton", "strict", ""
            ),
            "triton host wrapper": lambda: ts.forward(g, u),
            "eager": lambda: eager_swiglu(g, u),
            "torch.compile": lambda: cs(g, u),
        },
        "dense_gemm.o_proj": {
            "dispatch": lambda: gemm(xo, wo),
            "torch.library op": lambda: op_shell("dense_gemm").call_forward(
                {"x": xo, "weight": wo, "bias": None}, {}, "triton", "strict", ""
            ),
            "triton host wrapper": lambda: tg.forward(xo, wo, None, cfg),
            "cublas": lambda: torch.nn.functional.linear(xo, wo),
        },
    }
    rows = []
    with torch.no_grad():
        for op, fns in layers.items():
            for name, fn in fns.items():
                us = per_call_us(fn, args.n)
                rows.append({"op": op, "layer": name, "mode": "eager_loop", "us_per_call": us})
                print(f"{op:18s} {name:26s} {us:8.1f} us/call", flush=True)
            for name in ("dispatch", "eager", "torch.compile", "cublas"):
                if name in fns:
                    us = graph_us(fns[name])
                    rows.append({"op": op, "layer": name, "mode": "graph", "us_per_call": us})
                    print(f"{op:18s} {name + ' (graph)':26s} {us} us/call", flush=True)
    write(args.out, {"benchmark": "host_overhead", "env": env_stamp(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
