"""The cost of tensor parallelism's segmented form at TP 1 on the GPU: segmented_gemm
(segments = 8, Triton) against dense_gemm (Triton, and dispatch's default) and cuBLAS on
Muse Glimmer's row-parallel projections (forward) and column-parallel ones (backward dx,
the reduction over N), bf16, M tokens; and the shard bits (adjacent tree of t shards'
partials equal to the one-rank call) on the GPU.

    python benchmarks/segmented_gemm_gpu.py --out benchmarks/results/segmented_gemm_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract import dispatch  # noqa: E402
from opcontract.backends.fixed_order import adjacent_tree_sum  # noqa: E402

HID, INTER, QD = 6656, 19968, 4096  # hidden, intermediate, q heads x head_dim
CASES = [  # (name, N, K): y[M, N] = x[M, K] @ w[N, K].T, K the reduction TP splits
    ("o_proj forward (row-parallel K)", HID, QD),
    ("down_proj forward (row-parallel K)", HID, INTER),
    ("q_proj backward dx (column-parallel N)", HID, QD),
    ("gate_up backward dx (column-parallel N)", HID, 2 * INTER),
]


def timings(seg, dense_t, dense, x, w, S: int) -> dict[str, float]:
    """Median ms of each provider on x @ w.T."""
    dense(x, w)
    default = dispatch.last_provenance().implementation
    return {
        "segmented_gemm (triton, 8 segments)": common.bench(lambda: seg(x, w, segments=S))[0],
        "dense_gemm (triton)": common.bench(lambda: dense_t(x, w))[0],
        f"dense_gemm (default: {default})": common.bench(lambda: dense(x, w))[0],
        "cuBLAS F.linear": common.bench(lambda: torch.nn.functional.linear(x, w))[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="1,64,4096")
    ap.add_argument("--segments", type=int, default=8)
    args = ap.parse_args()
    S = args.segments
    seg = dispatch.op("segmented_gemm", backend="triton")
    dense_t = dispatch.op("dense_gemm", backend="triton")
    dense = dispatch.op("dense_gemm")
    tflops = common.matmul_tflops()
    rows = []
    for name, N, K in CASES:
        g = torch.Generator(device="cuda").manual_seed(N + K)
        w = (0.02 * torch.randn(N, K, device="cuda", generator=g)).bfloat16()
        for M in [int(m) for m in args.m.split(",")]:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            with torch.no_grad():
                full = seg(x, w, segments=S)
                bits = {}
                for t in (2, 4, 8):
                    c = K // t
                    parts = [seg(x[:, r * c : (r + 1) * c], w[:, r * c : (r + 1) * c],
                                 segments=S // t) for r in range(t)]  # fmt: skip
                    bits[t] = torch.equal(adjacent_tree_sum(torch.stack(parts)), full)
                ms = timings(seg, dense_t, dense, x, w, S)
            flops = 2 * M * N * K
            row = dict(case=name, M=M, N=N, K=K, ms=ms,
                       tflops={k: flops / v / 1e9 for k, v in ms.items()},
                       floor_ms=flops / (tflops * 1e9),
                       ratio_segmented_to_dense_triton=ms["segmented_gemm (triton, 8 segments)"]
                       / ms["dense_gemm (triton)"],
                       shards_bitwise_equal=bits)  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    common.write(args.out, dict(benchmark="segmented_gemm_gpu", env=common.env_stamp(),
                                matmul_tflops=tflops, segments=S, rows=rows))  # fmt: skip


if __name__ == "__main__":
    main()
