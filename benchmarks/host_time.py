"""Host time per eager call at decode sizes, opcontract's dispatch against torch's own op.

    python benchmarks/host_time.py --out results.json [--label new] [--n 200 --rounds 30]

An eager decode step issues ~15 op calls per layer from Python under torch.no_grad(): what
bounds it is the host's time to issue each call, not the GPU's to run it. Each round issues
``n`` calls back to back without synchronising and times that on the host (the GPU queue
holds them; it drains before the next round); the median round over the calls is the host
time per call. Ours and the peer's rounds alternate, and the ratio is the median of the
rounds' ratios (the host drifts by several times within a minute). The GPU time of one
call (CUDA-graph replay) is reported beside it: where it exceeds the host time, a loop of
calls is GPU-bound and the host figure is what Python adds. Run it under another
checkout's PYTHONPATH (``--label``) to compare two commits on one host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import env_stamp  # noqa: E402

from opcontract import dispatch  # noqa: E402

H, INTER, Q = 6656, 19968, 4096  # Muse Glimmer's hidden, intermediate and q_proj widths


def host_us(fn, n: int, rounds: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def paired_host_us(ours, peer, n: int, rounds: int) -> tuple[float, float, float]:
    """Host time per call of ``ours`` and ``peer`` timed in alternating rounds (the host's
    drift hits both alike): the median of each, and the median of the per-round ratios."""
    for fn in (ours, peer):
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    a, b = [], []
    for _ in range(rounds):
        for fn, acc in ((ours, a), (peer, b)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            acc.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
    return statistics.median(a), statistics.median(b), ratio


def gpu_us(fn) -> float | None:
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print("graph timing failed:", repr(e)[:120])
        return None


def cases(parameters: bool = False):
    """The calls and their torch peers; ``parameters``: the weights as nn.Parameter, as a
    model holds them (requires_grad, under no_grad as a decode step runs)."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    x, r, w = randn(1, H), randn(1, H), randn(H) * 0.1
    gu = randn(1, 2 * INTER)
    gate, up = randn(1, INTER), randn(1, INTER)
    wq = randn(Q, H) / 80
    wqkvg, wo = randn(8704, H) / 80, randn(H, Q) / 64  # the grouped q/k/v/gate and o_proj
    if parameters:
        w, wq, wqkvg, wo = (torch.nn.Parameter(t) for t in (w, wq, wqkvg, wo))
    rms, add_norm = dispatch.op("rms_norm"), dispatch.op("fused_add_rms_norm")
    swiglu, gemm = dispatch.op("swiglu"), dispatch.op("dense_gemm")
    F = torch.nn.functional
    return {
        "rms_norm T=1": (
            lambda: rms(x, w, variant="plain", eps=1e-5),
            lambda: F.rms_norm(x, (H,), w, 1e-5),
            "F.rms_norm",
        ),
        "fused_add_rms_norm T=1": (
            lambda: add_norm(x, r, w, variant="plain", eps=1e-5),
            lambda: F.rms_norm(x + r, (H,), w, 1e-5),
            "x + r, F.rms_norm",
        ),
        "swiglu packed T=1": (
            lambda: swiglu(gu, layout="packed"),
            lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:],
            "F.silu(g) * u",
        ),
        "swiglu separate T=1": (
            lambda: swiglu(gate, up),
            lambda: F.silu(gate) * up,
            "F.silu(g) * u",
        ),
        "dense_gemm q_proj M=1 (no tuned entry)": (
            lambda: gemm(x, wq),
            lambda: F.linear(x, wq),
            "F.linear",
        ),
        "dense_gemm qkv_gate M=1": (
            lambda: gemm(x, wqkvg),
            lambda: F.linear(x, wqkvg),
            "F.linear",
        ),
        "dense_gemm o_proj M=1": (
            lambda: gemm(x[:, :Q], wo),
            lambda: F.linear(x[:, :Q], wo),
            "F.linear",
        ),
    }


def layers(n: int, rounds: int) -> list[dict]:
    """rms_norm T=1 taken apart: where an eager call's host time goes, layer by layer, each
    layer timed in every round (round robin: the host's drift hits them alike)."""
    from opcontract.backends.triton import LAUNCH
    from opcontract.backends.triton import rms_norm as tn
    from opcontract.backends.triton import rms_norm_kernels as k
    from opcontract.backends.triton.launch import _COMPILED, _tail, launch, prepared
    from opcontract.dispatch import call_cache
    from opcontract.dispatch.shell import op_shell

    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(H, device="cuda", dtype=torch.bfloat16))
    y = torch.empty_like(x)
    f = dispatch.op("rms_norm")
    f(x, w, eps=1e-5)
    f(x, w, eps=1e-5)
    hit = call_cache.get(call_cache.key(f._route, (x, w), {"eps": 1e-5}))
    sh, route = op_shell("rms_norm"), hit.route
    meta = dict(VARIANT=0, BLOCK_H=8192, W_FIRST=True, num_warps=8, STORE_RSTD=False)
    args = (x, w, y, y, H, H, 1e-5)
    launch(k._rms_fwd_kernel, (1,), *args, **meta)
    go = prepared(k._rms_fwd_kernel, (1,), args, meta)
    addresses = (x.data_ptr(), w.data_ptr(), y.data_ptr(), y.data_ptr(), H, H, 1e-5)
    compiled = _COMPILED[next(iter(kk for kk in _COMPILED if kk[0] == id(k._rms_fwd_kernel)))][1]
    stream = torch._C._cuda_getCurrentRawStream(0)
    tail = (*args, *_tail(k._rms_fwd_kernel, args, {**LAUNCH, **meta}))
    fns = {
        "dispatch.op call": lambda: f(x, w, eps=1e-5),
        "memo lookup (key + get)": lambda: call_cache.get(
            call_cache.key(f._route, (x, w), {"eps": 1e-5})
        ),
        "the signature's call plan": (lambda: hit.plan(x, w)) if callable(hit.plan) else None,
        "shell run_forward (from the memo entry)": lambda: sh.run_forward(
            route, {"x": x, "weight": w}, hit.params, grad=False
        ),
        "triton host wrapper norm_forward": lambda: tn.norm_forward(
            x, w, None, "plain", 1e-5, store_rstd=False
        ),
        "launch() of the kernel alone": lambda: launch(k._rms_fwd_kernel, (1,), *args, **meta),
        "prepared go() alone (addresses)": (lambda: go(*addresses)) if go is not None else None,
        "CompiledKernel.run alone": lambda: compiled.run(
            1,
            1,
            1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *tail,
        ),
        "CompiledKernel.run alone, addresses for tensors": lambda: compiled.run(
            1,
            1,
            1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *addresses,
            *tail[len(addresses) :],
        ),
        "torch.empty_like": lambda: torch.empty_like(x),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (H,), w, 1e-5),
    }
    fns = {name: fn for name, fn in fns.items() if fn is not None}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    peer = times["F.rms_norm"]
    rows = []
    for name, ts in times.items():
        row = {
            "op": "rms_norm T=1",
            "layer": name,
            "host_us": statistics.median(ts),
            "over_F_rms_norm": statistics.median(a / b for a, b in zip(ts, peer, strict=True)),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    try:  # the kernels F.rms_norm launches
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.nn.functional.rms_norm(x, (H,), w, 1e-5)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        rows.append({"op": "rms_norm T=1", "layer": "F.rms_norm kernels", "kernels": kernels})
        print(json.dumps(rows[-1]), flush=True)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print("profile failed:", repr(e)[:200])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--layers", action="store_true", help="also take rms_norm T=1 apart")
    ap.add_argument("--fuse-max-bytes", type=int, default=None,
                    help="dense_gemm's FUSE_MAX_BYTES (one launch up to it)")  # fmt: skip
    ap.add_argument("--only", default="", help="only the cases whose name has this text")
    ap.add_argument("--parameters", action="store_true",
                    help="weights as nn.Parameter (a model's), not plain tensors")  # fmt: skip
    args = ap.parse_args()
    if args.fuse_max_bytes is not None:
        from opcontract.backends.triton import dense_gemm

        dense_gemm.FUSE_MAX_BYTES = args.fuse_max_bytes
    rows = []
    with torch.no_grad():
        for name, (ours, peer, peer_name) in cases(args.parameters).items():
            if args.only not in name:
                continue
            ours()
            mine, theirs, ratio = paired_host_us(ours, peer, args.n, args.rounds)
            row = {
                "op": name,
                "label": args.label,
                "weights": "nn.Parameter" if args.parameters else "tensor",
                "opcontract_host_us": mine,
                "peer": peer_name,
                "peer_host_us": theirs,
                "ratio": ratio,  # the median of the rounds' ratios (paired rounds)
                "opcontract_gpu_us": gpu_us(ours),
                "peer_gpu_us": gpu_us(peer),
                "implementation": dispatch.last_provenance().implementation
                if dispatch.last_provenance()
                else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    with torch.no_grad():
        out_layers = layers(args.n, args.rounds) if args.layers else []
    out = {
        "benchmark": "host_time",
        "layers": out_layers,
        "command": " ".join(["python", *sys.argv]),
        "env": env_stamp(),
        "n": args.n,
        "rounds": args.rounds,
        "fuse_max_bytes": args.fuse_max_bytes,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
