"""Where the Triton softcap_logprob backward spends its time on one GPU, and which launch
configs of its three kernels are faster without moving bits: Muse Glimmer's head, bf16.

Per vocabulary chunk the backward runs the grad-logits kernel (recomputes the chunk's
logits), the grad_weight GEMM (K = T) and the grad_hidden GEMM (K = chunk). Each is timed on
the first chunk; then the whole backward is timed per config, its gradients compared
bitwise with the shipped config's.

    python benchmarks/lm_head_backward_explore.py --out results.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench, env_stamp, matmul_tflops, write  # noqa: E402

from opcontract.backends.triton import LAUNCH  # noqa: E402
from opcontract.backends.triton import softcap_logprob as sl  # noqa: E402
from opcontract.backends.triton import softcap_logprob_kernels as k  # noqa: E402

H, V = 6656, 202048
MULT, CAP = 0.19611613513818404, 20.0
GEMMS = [
    {"block_m": 128, "block_n": 128, "group_m": 8, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "group_m": 8, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 256, "group_m": 8, "num_warps": 8, "num_stages": 3},
    {"block_m": 256, "block_n": 128, "group_m": 8, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "group_m": 16, "num_warps": 4, "num_stages": 4},
]
LOGITS = [
    {"block_t": 128, "num_warps": 8, "num_stages": 3, "group_t": 8},
    {"block_t": 128, "num_warps": 8, "num_stages": 4, "group_t": 8},
    {"block_t": 128, "num_warps": 4, "num_stages": 3, "group_t": 8},
    {"block_t": 64, "num_warps": 4, "num_stages": 4, "group_t": 8},
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    global H, V
    dev, T = ("cpu", 16) if args.smoke else ("cuda", args.T)
    if args.smoke:
        H, V = 256, 4100  # two vocabulary chunks
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.float32 if args.smoke else torch.bfloat16
    hidden = torch.randn(T, H, device=dev, generator=g).to(dt)
    weight = (torch.randn(V, H, device=dev, generator=g) * H**-0.5).to(dt)
    targets = torch.randint(0, V, (T,), device=dev, generator=g)
    grad_lp = torch.randn(T, device=dev, generator=g)
    res = sl.forward_all(hidden, weight, targets, multiplier=MULT, softcap=CAP)
    kw = dict(multiplier=MULT, softcap=CAP, ignore_index=-100)

    def backward():
        return sl.backward(hidden, weight, targets, res.lse, None, grad_lp, None, None, **kw)

    rate = 1.0 if args.smoke else matmul_tflops()

    def timed(fn, **kw) -> float:
        if args.smoke:
            fn()
            return 1.0
        return bench(fn, **kw)[0]

    rows = []
    shipped = dict(sl.GRAD_GEMM)
    ref = backward()
    n = sl.GRAD_CHUNK
    gbuf = torch.empty(T, n, dtype=hidden.dtype, device=dev)
    gw = torch.empty(n, H, dtype=hidden.dtype, device=dev)
    gh = torch.zeros(T, H, dtype=torch.float32, device=dev)
    scale, cap = sl._scalars(MULT, CAP)
    chunk_flop = 2 * T * H * n
    bk = sl.BLOCK_K[str(dt).removeprefix("torch.")]

    def grad_logits(cfg):
        grid = (sl.cdiv(T, cfg["block_t"]) * sl.cdiv(n, sl.BLOCK_V),)
        k._grad_logits_kernel[grid](
            hidden,
            weight,
            targets,
            res.lse,
            res.lse,
            grad_lp,
            grad_lp,
            grad_lp,
            gbuf,
            T,
            V,
            H,
            hidden.stride(0),
            weight.stride(0),
            gbuf.stride(0),
            0,
            n,
            scale,
            cap,
            MULT,
            -100,
            0.0,
            HAS_CAP=True,
            ENTROPY=False,
            SMOOTH=False,
            INTERPRET=args.smoke,
            PROMOTE=sl.GEMM_K_BLOCK // bk,
            EVEN_K=H % bk == 0,
            BLOCK_T=cfg["block_t"],
            BLOCK_V=sl.BLOCK_V,
            BLOCK_K=bk,
            GROUP_T=cfg["group_t"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **LAUNCH,
        )

    def grad_w():
        sl._gemm(
            gbuf,
            hidden,
            gw,
            n,
            H,
            T,
            (1, gbuf.stride(0)),
            (hidden.stride(0), 1),
            (gw.stride(0), 1),
            accumulate=False,
        )

    def grad_h():
        sl._gemm(
            gbuf,
            weight[:n],
            gh,
            T,
            H,
            n,
            (gbuf.stride(0), 1),
            (weight.stride(0), 1),
            (gh.stride(0), 1),
            accumulate=True,
        )

    for cfg in GEMMS:
        sl.GRAD_GEMM = cfg
        try:
            for name, fn in (("grad_weight", grad_w), ("grad_hidden", grad_h)):
                ms = timed(fn, rep_ms=200)
                rows.append(
                    {
                        "kernel": name,
                        "chunk": n,
                        "T": T,
                        "config": cfg,
                        "ms": ms,
                        "tflops": chunk_flop / ms / 1e9,
                    }
                )
                print(rows[-1], flush=True)
        except Exception as exc:  # e.g. too much shared memory
            rows.append({"kernel": "gemm", "config": cfg, "error": repr(exc)[:200]})
            print(rows[-1], flush=True)
    sl.GRAD_GEMM = shipped
    for cfg in LOGITS:
        try:
            ms = timed(lambda: grad_logits(cfg), rep_ms=200)  # noqa: B023
            rows.append(
                {
                    "kernel": "grad_logits",
                    "chunk": n,
                    "T": T,
                    "config": cfg,
                    "ms": ms,
                    "tflops": chunk_flop / ms / 1e9,
                }
            )
        except Exception as exc:
            rows.append({"kernel": "grad_logits", "config": cfg, "error": repr(exc)[:200]})
        print(rows[-1], flush=True)
    # the whole backward per GEMM config (logits config shipped), bits against the shipped
    for cfg in GEMMS:
        sl.GRAD_GEMM = cfg
        try:
            out = backward()
            ms = timed(backward, warmup_ms=300, rep_ms=1500)
        except Exception as exc:
            rows.append({"kernel": "backward", "config": cfg, "error": repr(exc)[:200]})
            continue
        rows.append(
            {
                "kernel": "backward",
                "T": T,
                "config": cfg,
                "ms": ms,
                "x_floor_3_gemms": ms / (3 * 2 * T * H * V / rate / 1e9),
                "bits_equal_to_shipped": all(
                    torch.equal(a, b) for a, b in zip(out, ref, strict=True)
                ),
            }
        )
        print(rows[-1], flush=True)
    sl.GRAD_GEMM = shipped
    write(
        args.out,
        {
            "benchmark": "lm_head_backward_explore",
            "env": env_stamp(),
            "ceilings": {"bf16_matmul_tflops": rate},
            "shape": {"T": T, "H": H, "V": V},
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
