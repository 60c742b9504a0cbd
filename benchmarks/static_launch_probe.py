"""Host time per eager call with Triton's launcher against torch's static CUDA launcher
(``launch.STATIC``), the two alternated round by round in one process so that the host's
drift between runs (F.rms_norm at 10-16 us from run to run) cancels.

    python benchmarks/static_launch_probe.py --out results.json [--rounds 40 --n 200]
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
from host_time import cases  # noqa: E402


def _round(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    from opcontract.backends.triton import launch
    from opcontract.backends.triton import rms_norm_kernels as k

    H = 6656
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    meta = dict(VARIANT=0, BLOCK_H=8192, W_FIRST=True, num_warps=8, STORE_RSTD=False)
    all_cases = {
        "launch() of the rms_norm kernel alone": (
            lambda: launch.launch(k._rms_fwd_kernel, (1,), x, w, y, y, H, H, 1e-5, **meta) or y,
            lambda: torch.empty_like(x),
            "torch.empty_like",
        ),
        **cases(parameters=True),
    }
    rows = []
    with torch.no_grad():
        for name, (ours, peer, peer_name) in all_cases.items():
            times = {"triton": [], "static": [], "peer": []}
            outs = {}
            for how in ("triton", "static"):
                launch.STATIC = how == "static"
                launch.clear()
                for _ in range(3):
                    out = ours()
                torch.cuda.synchronize()
                outs[how] = (out if isinstance(out, torch.Tensor) else out[0]).clone()
                handles = [e[3] is not None for e in launch._COMPILED.values()]
                if how == "static":
                    static_handles = f"{sum(handles)} of {len(handles)}"
            for _ in range(a.rounds):
                for how in ("triton", "static"):
                    launch.STATIC = how == "static"
                    launch.clear()
                    ours()  # through the JIT once: the next calls take the handle
                    times[how].append(_round(ours, a.n))
                times["peer"].append(_round(peer, a.n))
            row = {
                "op": name,
                "peer": peer_name,
                **{f"{k}_host_us": statistics.median(v) for k, v in times.items()},
                "static_handles": static_handles,
                "bits_equal": bool(torch.equal(outs["triton"], outs["static"])),
            }
            row["triton_ratio"] = row["triton_host_us"] / row["peer_host_us"]
            row["static_ratio"] = row["static_host_us"] / row["peer_host_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    launch.STATIC = True
    out = {
        "benchmark": "static_launch_probe",
        "command": " ".join(["python", *sys.argv]),
        "env": env_stamp(),
        "weights": "nn.Parameter, under torch.no_grad()",
        "n": a.n,
        "rounds": a.rounds,
        "rows": rows,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
