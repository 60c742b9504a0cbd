"""The sampler head at decode sizes, by schedule: host time per eager call, GPU time of a
graph replay, and whether the bits equal the canonical schedule's.

    python benchmarks/softcap_logits_decode.py --out results.json [--T 1,16,64]

Muse Glimmer's head (H 6656, V 202048, bf16, multiplier 1/sqrt(26), soft cap 20). The TMA
schedule passes TensorDescriptor arguments, which the launch cache cannot key, so each of
its calls goes through Triton's JIT; the pointer schedules ("tiles", "persistent") do not.
Host time: the median of ``--calls`` back-to-back eager calls, each timed on the host, the
GPU synchronised only around the loop (with the weight read per call at ~0.6 ms, the GPU
stays behind, so the loop times the host). GPU time: a captured graph's replays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract import dispatch  # noqa: E402
from opcontract.tuning.sweep import time_ms  # noqa: E402

H, V = 6656, 202048
KW = dict(multiplier=26**-0.5, softcap=20.0)


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", default="1,16,64")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    floor_ms = w.numel() * w.element_size() / (common.copy_gbps() * 1e9) * 1e3
    rows = []
    for T in (int(t) for t in args.T.split(",")):
        h = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        want = None
        for schedule in ("tma", "tiles", "persistent"):
            f = dispatch.op("softcap_logits", backend="triton", config={"schedule": schedule})
            with torch.no_grad():
                out = f(h, w, **KW)
                if want is None:
                    want = out
                row = {
                    "T": T,
                    "schedule": schedule,
                    "bits_equal_tma": bool(
                        torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
                    ),
                    "host_us_per_call": host_us(lambda f=f, h=h: f(h, w, **KW), args.calls),
                    "gpu_ms_graph": time_ms(lambda f=f, h=h: f(h, w, **KW), "cuda", "graph"),
                }
            row["x_weight_read"] = row["gpu_ms_graph"] / floor_ms
            rows.append(row)
            print(row, flush=True)
    out = {
        "benchmark": "softcap_logits_decode",
        "env": common.env_stamp(),
        "note": args.note,
        "weight_read_floor_ms": floor_ms,
        "rows": rows,
    }
    common.write(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
