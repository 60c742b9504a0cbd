"""Host time per eager call with a module's weights (nn.Parameter) against plain tensors.

    python benchmarks/host_time_parameters.py --out results.json [--label new] [--device cpu]

Every model's weights are nn.Parameter, a Tensor subclass: a dispatch layer that keys its
memo or its eager fast path on ``type(t) is torch.Tensor`` sends every such call down the
slow path (bind, select, the library op). Each row times the same op on the same inputs
under ``torch.no_grad()``, once with the weight a Parameter and once a plain tensor: the
median over rounds of ``n`` back-to-back calls, per call. Run it under another checkout's
PYTHONPATH (``--label``) to compare two commits on one host.
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


def per_call_us(fn, n: int, rounds: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="new")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    dev, dt = a.device, torch.bfloat16
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    H = 64 if dev == "cpu" else 6656  # small on the CPU: the torch kernels' own time stays low
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, H, device=dev, dtype=dt, generator=g)
    w_norm = torch.randn(H, device=dev, dtype=dt, generator=g)
    w_proj = torch.randn(H, H, device=dev, dtype=dt, generator=g) / 8
    rms, gemm = dispatch.op("rms_norm"), dispatch.op("dense_gemm")
    cases = {
        "rms_norm T=1": (lambda w: rms(x, w, variant="plain", eps=1e-5), w_norm),
        "dense_gemm M=1": (lambda w: gemm(x, w), w_proj),
    }
    rows = []
    with torch.no_grad():
        for name, (call, w) in cases.items():
            p = torch.nn.Parameter(w.clone(), requires_grad=True)
            row = {"op": name, "label": a.label, "device": dev, "H": H,
                   "parameter_us": per_call_us(lambda c=call, p=p: c(p), a.n, a.rounds, sync),
                   "tensor_us": per_call_us(lambda c=call, w=w: c(w), a.n, a.rounds, sync),
                   "implementation": dispatch.last_provenance().implementation}  # fmt: skip
            row["ratio"] = row["parameter_us"] / row["tensor_us"]
            rows.append(row)
            print(row, flush=True)
    path = Path(a.out)
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    keep = [r for r in old.get("rows", []) if r.get("label") != a.label]
    payload = {"benchmark": "host_time_parameters", "command": " ".join(["python", *sys.argv]),
               "env": env_stamp(), "rows": keep + rows}  # fmt: skip
    path.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
