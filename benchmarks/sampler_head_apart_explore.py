"""The sampler head (softcap_logits) at decode sizes with its logits' GEMM run apart: the
dense GEMM at a decode tile (or the CuTe GEMM) writes the float32 acc, the partials kernel
reads it back. Per T and GEMM config: GPU time of a graph replay against the fused kernel
and the weight-read floor, and whether logits and lse equal the fused kernel's, bitwise.

    python benchmarks/sampler_head_apart_explore.py --out results.json [--T 1,16,64]

Muse Glimmer's head (H 6656, V 202048, bf16, multiplier 1/sqrt(26), soft cap 20).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract import dispatch  # noqa: E402
from opcontract.backends.triton import softcap_logprob as slp  # noqa: E402
from opcontract.tuning.sweep import time_ms  # noqa: E402

H, V = 6656, 202048
KW = dict(multiplier=26**-0.5, softcap=20.0)


def triton_gemm(cfg: dict):
    """acc [T, n] = hidden @ weight_rows.T by the dense GEMM kernel at ``cfg``."""
    return functools.partial(slp.logits_dense, tile=cfg)


def cute_gemm(cfg: dict):
    from opcontract.backends.cute.dense_gemm import gemm

    def mm(hidden, weight_rows, acc):
        gemm(hidden, weight_rows, out=acc, config=cfg)

    return mm


def kernel_us(fn) -> dict[str, float]:
    """GPU time per call of each kernel ``fn`` launches, by name (ten calls)."""
    return {k[:60]: round(v, 2) for k, v in common.kernel_us(fn, calls=10).items() if v > 0}


def merge_rows(T: int, n_blocks: int, gen) -> list[dict]:
    """The merge kernel alone on random partials, every output on: GPU time of a graph
    replay."""
    from opcontract.backends.triton import softcap_logprob_kernels as k
    from opcontract.backends.triton.launch import launch

    f32 = dict(dtype=torch.float32, device="cuda")
    pmax = torch.randn(n_blocks, T, generator=gen, **f32) * 3
    psum = torch.rand(n_blocks, T, generator=gen, **f32) * 100 + 1
    pzs = torch.randn(n_blocks, T, generator=gen, **f32) * 50
    parg = torch.randint(0, V, (n_blocks, T), generator=gen, device="cuda", dtype=torch.int32)
    pzsum = torch.randn(n_blocks, T, generator=gen, **f32) * 10
    psq = torch.rand(n_blocks, T, generator=gen, **f32) * 10 + 1
    zt = torch.randn(T, generator=gen, **f32)
    tgt = torch.randint(0, V, (T,), generator=gen, device="cuda")
    outs = [torch.empty(T, **f32) for _ in range(8)]
    outs[4] = torch.empty(T, dtype=torch.int64, device="cuda")

    def run():
        launch(k._merge_kernel, (-(-T // 128),), pmax, psum, pzs, parg, pzsum, psq, zt, tgt,
               *outs, T, V, n_blocks, -100, ENTROPY=True, ARGMAX=True, ZSUM=True, SQ=True,
               BLOCK_R=128)  # fmt: skip

    row = {"T": T, "merge": "_merge_kernel", "gpu_us_graph": time_ms(run, "cuda", "graph") * 1e3}
    print(row, flush=True)
    return [row]


def apart(h, w, mm):
    slp.LOGITS_GEMMS["probe"] = mm
    no_target = torch.full((h.shape[0],), -1, dtype=torch.int64, device=h.device)
    r = slp.forward_all(h, w, no_target, **KW, ignore_index=-1, logits=True, logits_gemm="probe")
    return r.logits, r.lse


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", default="1,16,64")
    ap.add_argument("--cute", action="store_true", help="also the CuTe GEMM's decode tiles")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    slp.ACC_MIN_T = 1
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    floor_ms = w.numel() * w.element_size() / (common.copy_gbps() * 1e9) * 1e3
    fused = dispatch.op("softcap_logits", backend="triton")
    rows = []
    for T in (int(t) for t in args.T.split(",")):
        rows += merge_rows(T, -(-V // slp.BLOCK_V), g)
    for T in (int(t) for t in args.T.split(",")):
        h = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            want = fused(h, w, **KW)
            base = time_ms(lambda h=h: fused(h, w, **KW), "cuda", "graph")
            kernels = kernel_us(lambda h=h: fused(h, w, **KW))
        rows.append({"T": T, "gemm": "fused", "gpu_ms_graph": base, "x_floor": base / floor_ms,
                     "kernel_us": kernels})  # fmt: skip
        print(rows[-1], flush=True)
        cands = []
        for bm, bn, nw, ns in itertools.product(
            (16,) if T <= 16 else (64,), (64, 128, 256), (4, 8), (3, 4)
        ):
            cfg = dict(block_m=bm, block_n=bn, group_m=1, num_warps=nw, num_stages=ns)
            cands.append(("triton", cfg, triton_gemm(cfg)))
        if args.cute:
            for tn in (64, 128):
                cfg = {"tile_m": 64, "tile_n": tn, "group_m": 1, "overlap": 1}
                cands.append(("cute", cfg, cute_gemm(cfg)))
        # the schedule through dispatch, at its own tiles (the fused row is the default, tma)
        f = dispatch.op("softcap_logits", backend="triton", config={"schedule": "apart"})
        with torch.no_grad():
            z, lse = f(h, w, **KW)
            ms = time_ms(lambda h=h, f=f: f(h, w, **KW), "cuda", "graph")
            kernels = kernel_us(lambda h=h, f=f: f(h, w, **KW))
        rows.append({"T": T, "gemm": "schedule apart", "gpu_ms_graph": ms,
                     "x_floor": ms / floor_ms, "x_fused": ms / base, "kernel_us": kernels,
                     "bits_equal_fused": bool(torch.equal(z, want[0])
                                              and torch.equal(lse, want[1]))})  # fmt: skip
        print(rows[-1], flush=True)
        for kind, cfg, mm in cands:
            row = {"T": T, "gemm": kind, "config": cfg}
            try:
                with torch.no_grad():
                    z, lse = apart(h, w, mm)
                    row["bits_equal_fused"] = bool(torch.equal(z, want[0])
                                                   and torch.equal(lse, want[1]))  # fmt: skip
                    row["z_differing"] = int((z != want[0]).sum())
                    row["gpu_ms_graph"] = time_ms(lambda h=h, mm=mm: apart(h, w, mm), "cuda",
                                                  "graph")  # fmt: skip
                row["x_floor"] = row["gpu_ms_graph"] / floor_ms
                row["x_fused"] = row["gpu_ms_graph"] / base
                if row["x_fused"] < 0.9:
                    with torch.no_grad():
                        row["kernel_us"] = kernel_us(lambda h=h, mm=mm: apart(h, w, mm))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
    common.write(args.out, {
        "benchmark": "sampler_head_apart_explore",
        "env": common.env_stamp(),
        "note": args.note,
        "weight_read_floor_ms": floor_ms,
        "rows": rows,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
