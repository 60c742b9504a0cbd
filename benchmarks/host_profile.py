"""Where the host time of a decode-size call goes, layer by layer, down to the launch.

    python benchmarks/host_profile.py --out results.json [--profile profile.txt]

For dense_gemm at o_proj's shape (M = 1, K = 4096, N = 6656, bf16, the shipped table's
config) and rms_norm at T = 1: wall time per call of a loop of calls (synchronised once at
the end: the larger of host and GPU time) and the host time alone (``host_us``), for the
dispatch call, its host-side logic alone, the op function, the Triton host wrapper, each
kernel's launch through Triton's JIT with buffers allocated beforehand, the same kernels
(and a small one, the RMSNorm weight-gradient sum) launched through the compiled handle
(``CompiledKernel.run``, skipping the JIT's argument binding and cache lookup) and through
opcontract's ``launch`` (which does that after a specialization's first launch), and the
torch calls a wrapper makes. With ``--profile``, a cProfile of the dispatch loop sorted by
own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_graph, env_stamp, write  # noqa: E402

from opcontract import dispatch  # noqa: E402
from opcontract.backends.dense_gemm import K_BLOCK  # noqa: E402
from opcontract.backends.registry import implementation  # noqa: E402
from opcontract.dispatch import call_cache  # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # the best of three loops: the host's own noise
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def host_us(fn, n: int = 200) -> float:
    """Host time per call alone: a short loop timed without waiting for the GPU (its work
    queues behind; n stays far below the launch queue's depth)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def compiled_launcher(jit_fn, grid, args: tuple, meta: dict):
    """Launch once through the JIT, then return a closure that launches the compiled kernel
    through its handle with the same arguments (all of them, constexprs included, in
    signature order, as the JIT passes them)."""
    kernel = jit_fn[grid](*args, **meta)
    names = jit_fn.arg_names
    values = list(args) + [meta[n] for n in names[len(args) :]]
    run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    g = tuple(grid) + (1,) * (3 - len(grid))

    def launch():
        stream = torch.cuda.current_stream().cuda_stream
        run(g[0], g[1], g[2], stream, function, packed, None, None, None, *values)

    return launch


SHAPES = {"qkv_gate": (8704, 6656), "o_proj": (6656, 4096), "gate_up": (39936, 6656),
          "down_proj": (6656, 19968)}  # fmt: skip


def sum_variants(n: int) -> list[dict]:
    """Parallel partials summed by each tile's last program (fused) or by a second launch:
    wall time of an eager loop, host time alone and graph-replay GPU time, per Muse Glimmer
    shape at M = 1 and 16 with the table's Triton config for the bucket (bits checked
    equal)."""
    from opcontract.backends.registry import implementation
    from opcontract.backends.triton import dense_gemm as tg

    impl = implementation("triton.gemm")
    rows = []
    real = tg.fuse_sum
    try:
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
            for M in (1, 16):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                cfg = {**dispatch.explain("dense_gemm", x, w, backend="triton").config,
                       "parallel_partials": True}  # fmt: skip
                outs = {}
                for fused in (True, False):
                    tg.fuse_sum = lambda device, weight_bytes, f=fused: f
                    fn = lambda c=cfg, x=x, w=w: impl.forward(c, x=x, weight=w, bias=None)  # noqa: E731
                    outs[fused] = fn()
                    row = {"op": f"dense_gemm.{name} M={M}", "layer": "parallel partials, "
                           + ("summed by the last program" if fused else "summed by a 2nd launch"),
                           "us_per_call": per_call_us(fn, n), "host_us_per_call": host_us(fn),
                           "graph_us": bench_graph(fn, rep_ms=50) * 1e3}  # fmt: skip
                    rows.append(row)
                    print(row, flush=True)
                rows[-1]["bits_equal"] = rows[-2]["bits_equal"] = bool(
                    torch.equal(outs[True], outs[False])
                )
    finally:
        tg.fuse_sum = real
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile")
    args = ap.parse_args()
    from opcontract.backends.triton import LAUNCH
    from opcontract.backends.triton import dense_gemm as tg
    from opcontract.backends.triton import dense_gemm_kernels as gk
    from opcontract.backends.triton import rms_norm as tn
    from opcontract.backends.triton.launch import launch

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, 6656, device=dev, dtype=dt)
    w = torch.randn(6656, device=dev, dtype=dt)
    xo = torch.randn(1, 4096, device=dev, dtype=dt)
    wo = torch.randn(6656, 4096, device=dev, dtype=dt) / 64
    gemm, rms = dispatch.op("dense_gemm"), dispatch.op("rms_norm")
    rep = dispatch.explain("dense_gemm", xo, wo)
    cfg = {**tg.default_config(), **rep.config}
    print(rep, flush=True)

    M, K, N = 1, 4096, 6656
    chunks = K // K_BLOCK
    parts = torch.empty(chunks, M, N, dtype=torch.float32, device=dev)
    y = torch.empty(M, N, dtype=dt, device=dev)
    arrivals = torch.zeros(1024, dtype=torch.int32, device=dev)
    grid = (-(-M // cfg["block_m"]) * -(-N // cfg["block_n"]), chunks)
    g_args = (
        xo,
        wo,
        parts,
        y,
        M,
        N,
        K,
        xo.stride(0),
        1,
        1,
        wo.stride(0),
        N,
        1,
        M * N,
        0.0,
        y,
        arrivals,
    )
    g_meta = dict(
        ACCUMULATE=False, BIAS=False, INTERPRET=False, PROMOTE=K_BLOCK // 64,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=64, GROUP_M=cfg["group_m"],
        CHUNK=K_BLOCK, FUSE_SUM=True, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    # a small kernel (its GPU time far below its host time): the RMSNorm weight-gradient sum
    H, n_parts = 6656, 64
    rparts = torch.randn(n_parts, H, device=dev)
    rout = torch.empty(H, dtype=dt, device=dev)
    a_grid = (-(-H // tn.PARTIALS_BLOCK),)
    a_args = (rparts, rout, rparts, H, H, n_parts, H)
    a_meta = dict(BIAS=False, BLOCK=tn.PARTIALS_BLOCK, UNROLL=tn.PARTIALS_UNROLL, num_warps=2)

    def jit_gemm():
        gk._gemm_kernel[grid](*g_args, **g_meta, **LAUNCH)

    def jit_add():
        gk._add_partials_kernel[a_grid](*a_args, **a_meta, **LAUNCH)

    fast_gemm = compiled_launcher(gk._gemm_kernel, grid, g_args, {**g_meta, **LAUNCH})
    fast_add = compiled_launcher(gk._add_partials_kernel, a_grid, a_args, {**a_meta, **LAUNCH})
    y.zero_()
    fast_gemm()
    torch.cuda.synchronize()
    ref = gemm(xo, wo)
    torch.cuda.synchronize()
    fast_equal = bool(torch.equal(y, ref)) if cfg.get("parallel_partials") else None

    layers = {
        "dense_gemm.o_proj M=1": {
            "dispatch": lambda: gemm(xo, wo),
            "dispatch host side only": lambda: call_cache.get(
                call_cache.key(gemm._route, (xo, wo), {})
            ),
            "op function (bypass)": lambda: implementation("triton.gemm").forward(
                rep.config, x=xo, weight=wo, bias=None
            ),
            "triton host wrapper": lambda: tg.forward(xo, wo, None, rep.config),
            "jit launch gemm kernel": jit_gemm,
            "jit launch small kernel (plane sum)": jit_add,
            "compiled-handle launch gemm kernel": fast_gemm,
            "compiled-handle launch small kernel": fast_add,
            "launch() gemm kernel": lambda: launch(gk._gemm_kernel, grid, *g_args, **g_meta),
            "launch() small kernel": lambda: launch(
                gk._add_partials_kernel, a_grid, *a_args, **a_meta
            ),
            "torch.empty partials": lambda: torch.empty_like(parts),
            "torch.cuda.current_stream": lambda: torch.cuda.current_stream().cuda_stream,
            "cublas F.linear": lambda: torch.nn.functional.linear(xo, wo),
        },  # fmt: skip
        "rms_norm T=1": {
            "dispatch": lambda: rms(x, w, eps=1e-5),
            "dispatch host side only": lambda: call_cache.get(
                call_cache.key(rms._route, (x, w), {"eps": 1e-5})
            ),
            "triton host wrapper": lambda: tn.norm_forward(x, w, None, "plain", 1e-5),
        },
    }
    rows = []
    with torch.no_grad():
        for op, fns in layers.items():
            for name, fn in fns.items():
                us, host = per_call_us(fn, args.n), host_us(fn)
                rows.append({"op": op, "layer": name, "us_per_call": us, "host_us_per_call": host})
                print(f"{op:24s} {name:44s} {us:8.2f} us/call  host {host:8.2f} us", flush=True)
        rows += sum_variants(args.n // 4)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.n):
                gemm(xo, wo)
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            Path(args.profile).write_text(s.getvalue())
            print(s.getvalue()[:6000])
    write(
        args.out,
        {
            "benchmark": "host_profile",
            "env": env_stamp(),
            "config": rep.config,
            "compiled_handle_bits_equal_dispatch": fast_equal,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
