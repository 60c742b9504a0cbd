"""softcap_logprob forward+backward at Muse Glimmer's head, side by side with peers.

    python benchmarks/softcap_logprob_train.py --out results.json

The loss is the summed negative log-probability (upstream gradient -1 per token) for every
provider: opcontract (through dispatch, autograd), torch eager (autograd through float32
logits), Liger-Kernel's fused linear cross-entropy (reduction sum, soft cap, multiplier
folded into the hidden states), default and with accum_dtype=float32. Reported: median
time, peak memory above the inputs, gradient error against float64 autograd on a slice of
rows, and opcontract's run-to-run and batch invariance of grad_hidden rows.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench, copy_gbps, env_stamp, matmul_tflops, peak_extra_bytes, write  # noqa: E402

from opcontract import dispatch  # noqa: E402
from opcontract.backends.torch.softcap_logprob import reference  # noqa: E402

H, V = 6656, 202048
MULT, CAP = 0.19611613513818404, 20.0


def make(T: int, seed: int = 0, w_std: float = 0.3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * w_std).bfloat16()
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    t[::97] = -100
    return h, w, t


def ours(h, w, t, backend=None, plan=None):
    f = dispatch.op("softcap_logprob", backend=backend, plan=plan)
    return -f(h, w, t, multiplier=MULT, softcap=CAP).sum()


def eager(h, w, t):
    z = CAP * torch.tanh((h @ w.T).float() * MULT / CAP)
    keep = t != -100
    zt = z.gather(1, torch.where(keep, t, 0)[:, None])[:, 0]
    return -torch.where(keep, zt - torch.logsumexp(z, dim=-1), 0.0).sum()


def liger(accum_dtype):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(
        reduction="sum", softcap=CAP, ignore_index=-100, accum_dtype=accum_dtype
    )
    return lambda h, w, t: loss(w, h * MULT, t)


def fwd_bwd(fn, h, w, t):
    hh = h.detach().requires_grad_()
    ww = w.detach().requires_grad_()
    fn(hh, ww, t).backward()
    return hh.grad, ww.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--rep-ms", type=float, default=1500)
    ap.add_argument("--backend", default=None, help="force opcontract's head (e.g. cute.fused)")
    ap.add_argument("--plan", default=None, help="the backward plan (vocab_chunks, token_chunks)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = env_stamp()
    tflops, gbps = matmul_tflops(), copy_gbps()
    print(env, f"matmul {tflops:.0f} TFLOP/s, copy {gbps:.0f} GB/s", flush=True)
    providers = {"opcontract": functools.partial(ours, backend=args.backend, plan=args.plan)}
    h, w, t = make(8, seed=1)
    providers["opcontract"](h, w, t)
    served = dispatch.last_provenance().implementation
    if served != "triton.fused":  # the Triton head beside the one dispatch serves
        providers["opcontract.triton"] = functools.partial(ours, backend="triton", plan=args.plan)
    providers["torch.eager"] = eager
    try:
        providers["liger.flce"] = liger(None)
        providers["liger.flce_fp32"] = liger(torch.float32)
    except ImportError:
        print("liger-kernel not installed: peers limited to torch eager")

    # gradient accuracy vs float64 autograd, 256 rows
    h, w, t = make(256, seed=3)
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    (-reference(h64, w64, t, multiplier=MULT, softcap=CAP).sum()).backward()
    accuracy = {}
    for name, fn in providers.items():
        gh, gw = fwd_bwd(fn, h, w, t)
        accuracy[name] = {"grad_hidden": rel(gh, h64.grad), "grad_weight": rel(gw, w64.grad)}
        print(name, accuracy[name], flush=True)
    del h64, w64

    T_max = max(args.T)
    h, w, t = make(T_max)
    gh_full, gw_full = fwd_bwd(providers["opcontract"], h, w, t)
    gh_again, gw_again = fwd_bwd(providers["opcontract"], h, w, t)
    invariance = {
        "run_to_run_grad_hidden": bool(torch.equal(gh_full, gh_again)),
        "run_to_run_grad_weight": bool(torch.equal(gw_full, gw_again)),
    }
    gen = torch.Generator().manual_seed(5)
    for T in sorted({1, 3, 64, 1000, *args.T}):
        idx = torch.randperm(T_max, generator=gen)[:T].cuda()
        gh, _ = fwd_bwd(providers["opcontract"], h[idx], w, t[idx])
        invariance[f"grad_hidden_rows_T{T}"] = bool(torch.equal(gh, gh_full[idx]))
    if "opcontract.triton" in providers:  # the served head against triton.fused, bitwise
        gh_t, gw_t = fwd_bwd(providers["opcontract.triton"], h, w, t)
        invariance["equals_triton_grad_hidden"] = bool(torch.equal(gh_full, gh_t))
        invariance["equals_triton_grad_weight"] = bool(torch.equal(gw_full, gw_t))
        del gh_t, gw_t
    print(invariance, flush=True)
    del gh_full, gw_full, gh_again, gw_again

    rows = []
    for T in args.T:
        hh, tt = h[:T].contiguous(), t[:T].contiguous()
        floor = 3 * 2 * T * H * V / (tflops * 1e9)
        for name, fn in providers.items():
            run = functools.partial(fwd_bwd, fn, hh, w, tt)
            run()
            med, p20, p80 = bench(run, warmup_ms=1, rep_ms=args.rep_ms)
            mem = peak_extra_bytes(run)
            rows.append(
                {
                    "kernel": "softcap_logprob",
                    "provider": name,
                    "mode": "fwd+bwd",
                    "metric": "time",
                    "x_name": "T",
                    "x": T,
                    "median": med,
                    "p20": p20,
                    "p80": p80,
                    "unit": "ms",
                    "peak_extra_bytes": mem,
                    "gemm_floor_ms": floor,
                    "x_floor": med / floor,
                }
            )
            print(
                f"T={T:6d} {name:18s} {med:9.2f} ms  {med / floor:5.2f}x floor  "
                f"{mem / 2**30:6.2f} GiB",
                flush=True,
            )
    write(
        args.out,
        {
            "benchmark": "softcap_logprob_train",
            "env": env,
            "ceilings": {"bf16_matmul_tflops": tflops, "copy_gbps": gbps},
            "shape": {
                "H": H,
                "V": V,
                "multiplier": MULT,
                "softcap": CAP,
                "dtype": "bfloat16",
                "loss": "sum of -logprob",
            },
            "grad_accuracy_rel_err_vs_float64": accuracy,
            "invariance": invariance,
            "opcontract_implementation": served,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
