"""Memory-bound ops of Muse Glimmer's layer on one GPU: RMSNorm (plain, centred), fused
add + RMSNorm, SwiGLU (separate, packed) and the normalized embedding, forward and
forward+backward, side by side with torch eager, torch.compile of the same eager code and
Liger-Kernel where it has the op.

    python benchmarks/memory_bound_ops.py --out results.json
    python benchmarks/memory_bound_ops.py --smoke --out /tmp/smoke.json   # CPU, tiny shapes

Achieved bandwidth counts each input read once and each output written once (the
embedding's gradient is the whole [V, H] table), over the median time, against the
device-to-device copy rate measured in the same run. Eager calls include each provider's
host overhead; at T <= --graph-max-T the forward is also timed as a CUDA-graph replay (mode
"forward.graph"), the GPU time a decode loop under graphs sees; so is the embedding's at
every T, since its eager call syncs for the id range check. Forward+backward: leaves and
fixed random upstream gradients made once per case, gradients taken with autograd.grad
(nothing accumulates into .grad between calls); from --graph-train-min-T on it is also
replayed from a CUDA graph ("fwd+bwd.graph"): the GPU time, without the host's launches.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_graph, env_stamp, write  # noqa: E402

from opcontract import dispatch  # noqa: E402

H, INTER, V = 6656, 19968, 202048


def _eager_norm(x, w, variant, eps):
    x32 = x.float()
    y = x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)
    if variant == "plain":
        y = y * w.float()
    elif variant == "centred":
        y = y * (1.0 + w.float())
    return y.to(x.dtype)


def _eager_add_norm(x, r, w, eps):
    s = (x.float() + r.float()).to(x.dtype)
    return _eager_norm(s, w, "centred", eps), s


def _eager_swiglu(g, u):
    g32 = g.float()
    return (g32 * torch.sigmoid(g32) * u.float()).to(g.dtype)


def _eager_embedding(ids, table, eps):
    return _eager_norm(table[ids], None, "weightless", eps)


def cases(T: int, dev: str, dtype, small: bool):
    """name -> (inputs needing grad, callables by provider, bytes fwd, bytes fwd+bwd)."""
    h, i, v = (64, 96, 500) if small else (H, INTER, V)
    g = torch.Generator(device=dev).manual_seed(T)
    rn = lambda *s: torch.randn(*s, device=dev, generator=g).to(dtype)  # noqa: E731
    x, r, w, w0 = rn(T, h), rn(T, h), rn(h), rn(h) * 0.1
    gate, up = rn(T, i), rn(T, i)
    packed = torch.cat([gate, up], dim=-1)
    table = rn(v, h)
    ids = torch.randint(0, v, (T,), device=dev, generator=g)
    e = x.element_size()
    rms, add_rms = dispatch.op("rms_norm"), dispatch.op("fused_add_rms_norm")
    swiglu, embed = dispatch.op("swiglu"), dispatch.op("normalized_embedding")
    out = {
        "rms_norm.plain": (
            (x, w),
            {
                "opcontract": lambda x, w: rms(x, w, variant="plain", eps=1e-5),
                "eager": lambda x, w: _eager_norm(x, w, "plain", 1e-5),
            },
            (2 * T * h + h) * e,
            (5 * T * h + 2 * h) * e,
        ),
        "rms_norm.centred": (
            (x, w0),
            {
                "opcontract": lambda x, w: rms(x, w, variant="centred", eps=1e-5),
                "eager": lambda x, w: _eager_norm(x, w, "centred", 1e-5),
            },
            (2 * T * h + h) * e,
            (5 * T * h + 2 * h) * e,
        ),
        "fused_add_rms_norm.centred": (
            (x, r, w0),
            {
                "opcontract": lambda x, r, w: add_rms(x, r, w, variant="centred", eps=1e-8),
                "eager": lambda x, r, w: _eager_add_norm(x, r, w, 1e-8),
            },
            (4 * T * h + h) * e,
            (9 * T * h + 2 * h) * e,
        ),
        "swiglu.separate": (
            (gate, up),
            {
                "opcontract": lambda g_, u_: swiglu(g_, u_),
                "eager": _eager_swiglu,
            },
            3 * T * i * e,
            8 * T * i * e,
        ),
        "swiglu.packed": (
            (packed,),
            {
                "opcontract": lambda p: swiglu(p, layout="packed"),
                "eager": lambda p: _eager_swiglu(p[:, :i], p[:, i:]),
            },
            3 * T * i * e,
            8 * T * i * e,
        ),
        "normalized_embedding": (
            (table,),
            {
                "opcontract": lambda t_: embed(ids, t_, eps=1e-5),
                "eager": lambda t_: _eager_embedding(ids, t_, 1e-5),
            },
            (2 * T * h) * e + T * 8,
            (3 * T * h + v * h) * e + T * 8,  # the gradient is the dense [V, H] table
        ),
    }
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        plain = LigerRMSNorm(h, eps=1e-5, offset=0.0, casting_mode="gemma").to(dev, dtype)
        centred = LigerRMSNorm(h, eps=1e-5, offset=1.0, casting_mode="gemma", init_fn="zeros").to(
            dev, dtype
        )
        for name, module in (("rms_norm.plain", plain), ("rms_norm.centred", centred)):
            call = lambda x, w, m=module: m(x)  # noqa: E731
            call.params = (module.weight,)  # the weight it differentiates
            out[name][1]["liger"] = call
        out["swiglu.separate"][1]["liger"] = LigerSiLUMulFunction.apply
    except Exception as exc:  # not installed, or another API: recorded, not fatal
        print("liger unavailable:", repr(exc)[:200])
    for c in out.values():
        c[1]["torch.compile"] = torch.compile(c[1]["eager"], dynamic=False)
    return out


# Its eager call syncs with the host (the id range check): the graph replay gives GPU time.
GRAPH_ALWAYS = ("normalized_embedding",)


def _train_step(fn, inputs, provider: str):
    """Forward and backward of ``fn``: leaves and fixed random upstream gradients made once,
    gradients returned by autograd.grad (not accumulated into .grad, which would add a
    read-modify-write of every gradient to the op's own traffic)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=outs[0].device).manual_seed(1)
    ups = [torch.randn(o.shape, device=o.device, generator=gen).to(o.dtype) for o in outs]
    wrt = list(leaves)
    if provider == "liger":  # its weight is the module's parameter
        wrt = [t for t in leaves if t.dim() > 1] + [
            p for p in getattr(fn, "params", ()) if p.requires_grad
        ]

    def step():
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(list(outs), wrt, ups, allow_unused=True)

    return step


def _time(fn, device: str, rep_ms: float) -> float:
    if device == "cuda":
        from common import bench

        return bench(fn, rep_ms=rep_ms)[0]
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1, 64, 8192, 32768])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script")
    ap.add_argument("--rep-ms", type=float, default=200)
    ap.add_argument("--graph-max-T", type=int, default=64)
    ap.add_argument("--graph-train-min-T", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    T_list = [1, 8] if args.smoke else args.T
    gbps = None
    if dev == "cuda":
        from common import copy_gbps

        gbps = copy_gbps()
    rows = []
    for T in T_list:
        for name, (inputs, providers, b_fwd, b_both) in cases(T, dev, dtype, args.smoke).items():
            for prov, fn in providers.items():
                gc.collect()  # captured graphs' memory pools from the last case
                if dev == "cuda":
                    torch.cuda.empty_cache()
                try:
                    with torch.no_grad():
                        fwd = _time(lambda: fn(*inputs), dev, args.rep_ms)  # noqa: B023
                    step = _train_step(fn, inputs, prov)
                    fb = _time(step, dev, args.rep_ms)
                    timed = [("forward", fwd, b_fwd), ("fwd+bwd", fb, b_both)]
                    if dev == "cuda" and T >= args.graph_train_min_T:
                        try:  # GPU time alone: the step's launches replayed from a graph
                            timed.append(("fwd+bwd.graph", bench_graph(step, args.rep_ms), b_both))
                        except Exception as exc:  # e.g. a host sync inside the backward
                            print(name, prov, T, "fwd+bwd not capturable:", repr(exc)[:120])
                            torch.cuda.synchronize()
                    if dev == "cuda" and (T <= args.graph_max_T or name in GRAPH_ALWAYS):
                        with torch.no_grad():
                            g_ms = bench_graph(lambda: fn(*inputs), args.rep_ms)  # noqa: B023
                        timed.append(("forward.graph", g_ms, b_fwd))
                except Exception as exc:
                    rows.append(
                        {"kernel": name, "provider": prov, "x": T, "error": repr(exc)[:300]}
                    )
                    print(name, prov, T, "error", repr(exc)[:120])
                    continue
                for mode, ms, nbytes in timed:
                    gb_s = nbytes / ms / 1e6
                    rows.append(
                        {
                            "kernel": name,
                            "provider": prov,
                            "mode": mode,
                            "metric": "time",
                            "x_name": "T",
                            "x": T,
                            "median": ms,
                            "unit": "ms",
                            "bytes": nbytes,
                            "gb_per_s": gb_s,
                            "fraction_of_copy": gb_s / gbps if gbps else None,
                        }
                    )
                    print(
                        f"{name:28s} {prov:14s} T={T:6d} {mode:13s} {ms:9.4f} ms {gb_s:8.1f} GB/s",
                        flush=True,
                    )
    write(
        args.out,
        {
            "benchmark": "memory_bound_ops",
            "env": env_stamp(),
            "ceilings": {"copy_gbps": gbps},
            "dtype": str(dtype),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
