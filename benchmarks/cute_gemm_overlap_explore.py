"""The CuTe dense_gemm's main loop at training M on the H200: the plain loop (each 256-k
chunk's WGMMAs drained before its partial is added) against the overlapped one (two
partials: a chunk is added while the next chunk's WGMMAs run), at the group orders of the
config space, side by side with cuBLAS. Every variant's output is compared bitwise with the
plain loop's.

    python benchmarks/cute_gemm_overlap_explore.py --out results.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench, env_stamp, matmul_tflops, write  # noqa: E402
from dense_gemm import SHAPES  # noqa: E402

from opcontract.backends.cute import dense_gemm as dg  # noqa: E402

M_VALUES = (1024, 4096, 16384)
TILES = {"o_proj": {1024: (64, 128)}}  # the shipped table's tiles; (128, 128) elsewhere


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep-ms", type=float, default=150)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    peak = matmul_tflops()
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
        for M in M_VALUES:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            flops = 2 * M * N * K
            ms = bench(lambda: F.linear(x, w), rep_ms=args.rep_ms)[0]  # noqa: B023
            cublas = {"shape": name, "M": M, "provider": "cublas", "ms": ms}
            rows.append({**cublas, "tflops": flops / ms / 1e9})
            print(rows[-1], flush=True)
            tile_m, tile_n = TILES.get(name, {}).get(M, (128, 128))
            ref = None
            for overlap in (0, 1):
                for group_m in (1, 8, 16):
                    cfg = {"tile_m": tile_m, "tile_n": tile_n, "group_m": group_m,
                           "overlap": overlap}  # fmt: skip
                    y = dg.gemm(x, w, None, cfg)
                    ref = y if ref is None else ref
                    ms = bench(lambda: dg.gemm(x, w, None, cfg), rep_ms=args.rep_ms)[0]  # noqa: B023
                    rows.append(
                        {
                            "shape": name,
                            "M": M,
                            "provider": "cute",
                            "config": cfg,
                            "ms": ms,
                            "tflops": flops / ms / 1e9,
                            "fraction_of_cublas": cublas["ms"] / ms,
                            "bits_equal_to_plain_loop": bool(torch.equal(y, ref)),
                        }
                    )
                    print(rows[-1], flush=True)
    write(
        args.out,
        {
            "benchmark": "cute_gemm_overlap_explore",
            "env": env_stamp(),
            "ceilings": {"matmul_tflops": peak},
            "dtype": "bfloat16",
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
