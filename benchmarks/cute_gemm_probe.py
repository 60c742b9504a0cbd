"""GPU probe of the CuTe DSL dense_gemm (SM90): compile, numerics, invariance, parity, speed.

    python benchmarks/cute_gemm_probe.py --out cute_probe.json

Stages (each in its own try/except, printing the full traceback, so one failure hides no
other; the JSON is rewritten after every stage):
  env        versions, device
  smoke      a subprocess (timeout) compiles and runs small and Muse-sized cases: a hang or an
             illegal address there can't poison this process; the cute stages run only if it
             passed (--no-smoke skips the guard)
  compile    first-call time per kernel variant
  kit        the contract's conformance kit for cute.gemm (bf16, fp16; forward and grads)
  numerics   the four Muse shapes at M in {1, 16, 64, 1000, 4096, 8192}: rel. error vs float64
             (first 256 rows), rows bitwise vs M = 8192, bitwise vs triton.gemm
  configs    every tile config against the default, bitwise
  backward   dx, dw, db vs float64 and vs triton.gemm's backward
  timing     median ms (triton.testing.do_bench) of cute, triton and F.linear per shape and M
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # name: (N, K)
    "qkv_gate": (8704, 6656),
    "o_proj": (6656, 4096),
    "gate_up": (39936, 6656),
    "down_proj": (6656, 19968),
}
CHECK_M = [1, 16, 64, 1000, 4096, 8192]
TIME_M = [1, 16, 64, 256, 1024, 4096, 16384]
BUDGET_S = 220.0  # stop starting new timing work past this

T0 = time.time()


def _elapsed() -> float:
    return time.time() - T0


def _stage(results: dict, name: str, out: str | None):
    """Decorator-free stage runner: returns a context that records ok/error/traceback."""

    class _Ctx:
        def __enter__(self):
            print(f"\n=== {name} (t={_elapsed():.1f}s) ===", flush=True)
            self.t = time.time()
            results.setdefault(name, {})
            return results[name]

        def __exit__(self, et, ev, tb):
            rec = results[name]
            rec["seconds"] = round(time.time() - self.t, 2)
            if et is not None:
                rec["ok"] = False
                rec["error"] = "".join(traceback.format_exception(et, ev, tb))
                print(rec["error"], flush=True)
            else:
                rec.setdefault("ok", True)
            if out:
                _write(out, results)
            return True  # swallow: the next stage runs

    return _Ctx()


def _write(out: str, results: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=1, default=str) + "\n")


def _inputs(M, N, K, dtype=torch.bfloat16, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype) if bias else None
    return x, w, b


def _rel(y, x, w, b, rows=256):
    r = min(rows, x.shape[0])
    ref = x[:r].double() @ w.double().T
    if b is not None:
        ref = ref + b.double()
    return ((y[:r].double() - ref).norm() / ref.norm()).item()


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bitwise comparison: mismatching elements and the largest difference."""
    ne = a != b
    n = int(ne.sum().item())
    out = {"equal": n == 0, "mismatches": n, "of": a.numel()}
    if n:
        out["max_abs"] = (a.float() - b.float()).abs().max().item()
    return out


def _timed_fns(x, w, cute, tri, cute_ok: bool) -> dict:
    import torch.nn.functional as F

    fns = {"triton": lambda: tri(x, w), "cublas": lambda: F.linear(x, w)}
    if cute_ok:
        from opcontract.backends.cute import dense_gemm as dg

        fns = {"cute": lambda: cute(x, w), "cute_direct": lambda: dg.forward(x, w, None), **fns}
    return fns


# ----------------------------------------------------------------------------- smoke


def smoke() -> int:
    """Run in a subprocess: small and Muse-sized cases against float64. Exit 0 when all pass."""
    from opcontract.backends.cute import dense_gemm as dg

    ok = True
    cases = [
        (1, 64, 64, False),
        (37, 70, 300, True),
        (130, 136, 512, True),
        (1, 8704, 6656, False),
        (1000, 6656, 4096, True),
        (300, 256, 1000, False),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for M, N, K, bias in cases:
            x, w, b = _inputs(M, N, K, dtype, bias)
            t = time.time()
            y = dg.forward(x, w, b)
            torch.cuda.synchronize()
            rel = _rel(y, x, w, b)
            good = bool(torch.isfinite(y).all()) and rel < 8e-3
            ok &= good
            print(
                f"smoke {dtype} M={M} N={N} K={K} bias={bias}: rel {rel:.3g} "
                f"({time.time() - t:.2f}s) {'ok' if good else 'FAIL'}",
                flush=True,
            )
    return 0 if ok else 1


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cute_gemm_probe.json")
    ap.add_argument("--smoke", action="store_true", help="(internal) the guarded smoke run")
    ap.add_argument("--no-smoke", action="store_true", help="skip the subprocess guard")
    ap.add_argument("--smoke-timeout", type=float, default=150.0)
    args = ap.parse_args()
    if args.smoke:
        return smoke()

    res: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv])}
    cute_ok = True

    with _stage(res, "env", args.out) as r:
        import triton

        r["torch"] = torch.__version__
        r["triton"] = triton.__version__
        r["python"] = sys.version.split()[0]
        r["device"] = torch.cuda.get_device_name()
        r["capability"] = torch.cuda.get_device_capability()
        try:
            import cutlass

            r["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            r["cutlass_dsl"] = f"import failed: {e!r}"
            cute_ok = False
        from opcontract import dispatch

        for dt in (torch.bfloat16, torch.float32):
            x, w, b = _inputs(8, 64, 64, dt, True)
            r[f"explain_{dt}"] = str(dispatch.explain("dense_gemm", x, w, b))
        print(json.dumps(r, indent=1, default=str))

    if not args.no_smoke and cute_ok:
        with _stage(res, "smoke", args.out) as r:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
            try:
                p = subprocess.run(
                    [sys.executable, __file__, "--smoke"],
                    env=env,
                    timeout=args.smoke_timeout,
                    capture_output=True,
                    text=True,
                )
                r["returncode"] = p.returncode
                r["output"] = (p.stdout + p.stderr)[-6000:]
            except subprocess.TimeoutExpired as e:
                r["returncode"] = "timeout"
                r["output"] = str(e.stdout or "")[-3000:] + str(e.stderr or "")[-3000:]
            print(r["output"])
            r["ok"] = r["returncode"] == 0
            cute_ok = r["ok"]
            if not cute_ok:
                print("smoke failed: cute stages are skipped (run with --no-smoke to force)")

    from opcontract import dispatch

    cute = dispatch.op("dense_gemm", backend="cute.gemm")
    tri = dispatch.op("dense_gemm", backend="triton.gemm")

    if cute_ok:
        with _stage(res, "compile", args.out) as r:
            from opcontract.backends.cute import dense_gemm as dg

            for dt in (torch.bfloat16, torch.float16):
                for bias in (False, True):
                    x, w, b = _inputs(64, 256, 512, dt, bias)
                    t = time.time()
                    dg.forward(x, w, b)
                    torch.cuda.synchronize()
                    r[f"{dt}_bias{bias}_first_call_s"] = round(time.time() - t, 3)
                    t = time.time()
                    dg.forward(x, w, b)
                    torch.cuda.synchronize()
                    r[f"{dt}_bias{bias}_second_call_s"] = round(time.time() - t, 4)
            print(r)

        with _stage(res, "kit", args.out) as r:
            from opcontract.backends.registry import implementation
            from opcontract.conformance import run_kit
            from opcontract.contracts import get_contract

            c = get_contract("dense_gemm")
            for dt in ("bfloat16", "float16"):
                rs = run_kit(implementation("cute.gemm"), c, dt, device="cuda")
                r[dt] = [{"check": x.check, "ok": x.ok, "detail": x.detail} for x in rs]
                r["ok"] = r.get("ok", True) and all(x.ok for x in rs)
                for x in rs:
                    print(f"{dt} {x.check}: {'ok' if x.ok else 'FAIL'} {x.detail}")

        with _stage(res, "numerics", args.out) as r:
            all_ok = True
            for name, (N, K) in SHAPES.items():
                for bias in (False, True) if name == "qkv_gate" else (False,):
                    x, w, b = _inputs(max(CHECK_M), N, K, bias=bias, seed=1)
                    full = cute(x, w, b)
                    full_t = tri(x, w, b)
                    torch.cuda.synchronize()
                    for M in CHECK_M:
                        y = cute(x[:M], w, b) if M < x.shape[0] else full
                        yt = tri(x[:M], w, b) if M < x.shape[0] else full_t
                        rec = {
                            "rel_err": _rel(y, x[:M], w, b),
                            "rel_err_triton": _rel(yt, x[:M], w, b),
                            "rows_vs_M8192": _diff(y, full[:M]),
                            "vs_triton": _diff(y, yt),
                        }
                        key = f"{name}{'+bias' if bias else ''}_M{M}"
                        r[key] = rec
                        all_ok &= rec["rel_err"] < 8e-3 and rec["rows_vs_M8192"]["equal"]
                        print(
                            f"{key:24s} rel {rec['rel_err']:.3g} (triton "
                            f"{rec['rel_err_triton']:.3g})  invariant "
                            f"{rec['rows_vs_M8192']['equal']}  ==triton "
                            f"{rec['vs_triton']['equal']} "
                            f"({rec['vs_triton']['mismatches']} mismatches)",
                            flush=True,
                        )
                    # a random subset of rows, gathered (non-contiguous source rows)
                    idx = torch.randperm(x.shape[0], device="cuda")[:333]
                    r[f"{name}{'+bias' if bias else ''}_gather333"] = _diff(
                        cute(x[idx], w, b), full[idx]
                    )
                    del x, w, b, full, full_t
            r["ok"] = all_ok

        with _stage(res, "configs", args.out) as r:
            from opcontract.backends.cute import dense_gemm as dg

            N, K = SHAPES["o_proj"]
            x, w, b = _inputs(1000, N, K, bias=True, seed=2)
            base = dg.forward(x, w, b)
            for tm in dg.CONFIG_SPACE["tile_m"]:
                for tn in dg.CONFIG_SPACE["tile_n"]:
                    y = dg.forward(x, w, b, {"tile_m": tm, "tile_n": tn})
                    r[f"{tm}x{tn}"] = _diff(y, base)
                    print(f"tile {tm}x{tn} vs default: {r[f'{tm}x{tn}']}")

        with _stage(res, "backward", args.out) as r:
            for M, N, K in ((37, 70, 300), (512, 6656, 4096)):
                x, w, b = _inputs(M, N, K, bias=True, seed=3)
                grads = {}
                for label, fn in (("cute", cute), ("triton", tri)):
                    xs, ws, bs = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
                    y = fn(xs, ws, bs)
                    g = torch.Generator(device="cuda").manual_seed(4)
                    y.backward(torch.randn(y.shape, device="cuda", generator=g).to(y.dtype))
                    grads[label] = (xs.grad, ws.grad, bs.grad)
                g = torch.Generator(device="cuda").manual_seed(4)
                dy = torch.randn((M, N), device="cuda", generator=g).to(x.dtype).double()
                refs = (dy @ w.double(), dy.T @ x.double(), dy.sum(0))
                for i, nm in enumerate(("dx", "dw", "db")):
                    got = grads["cute"][i].double()
                    rel = ((got - refs[i]).norm() / refs[i].norm()).item()
                    r[f"M{M}_N{N}_K{K}_{nm}"] = {
                        "rel_err": rel,
                        "vs_triton": _diff(grads["cute"][i], grads["triton"][i]),
                    }
                    print(
                        f"backward M{M} N{N} K{K} {nm}: rel {rel:.3g} "
                        f"==triton {r[f'M{M}_N{N}_K{K}_{nm}']['vs_triton']['equal']}"
                    )

    with _stage(res, "timing", args.out) as r:
        from triton.testing import do_bench

        rows = []
        for name, (N, K) in SHAPES.items():
            w = (torch.randn(N, K, device="cuda") * K**-0.5).bfloat16()
            for M in TIME_M:
                if _elapsed() > BUDGET_S:
                    print(f"time budget spent: skipping {name} M={M} and later")
                    break
                x = torch.randn(M, K, device="cuda").bfloat16()
                row = {"shape": name, "M": M, "N": N, "K": K}
                for label, fn in _timed_fns(x, w, cute, tri, cute_ok).items():
                    try:
                        ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
                        row[label] = {"ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
                    except Exception:  # noqa: BLE001
                        row[label] = {"error": traceback.format_exc()[-2000:]}
                        print(row[label]["error"])
                rows.append(row)
                cells = "  ".join(
                    f"{k} {v['ms']:.4f}ms {v['tflops']:.0f}TF"
                    for k, v in row.items()
                    if isinstance(v, dict) and "ms" in v
                )
                print(f"{name:10s} M={M:6d}  {cells}", flush=True)
        r["rows"] = rows

    res["total_seconds"] = round(_elapsed(), 1)
    _write(args.out, res)
    print(f"\nwrote {args.out} ({res['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
