"""The seeded fuzz (opcontract.conformance.fuzz) of every op through every implementation this
machine runs, with the counts of results and violations, as the CPU suite's tests/test_fuzz.py
runs it, here on a GPU.

    python benchmarks/fuzz_counts.py --out results.json [--calls 400] [--device cuda]

A call that is neither the float64 reference's answer (the contract's tolerance and
nonfinite rule) nor a ContractViolation naming one of its arguments, or that modifies an
input, is a failure: its description goes into the row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import env_stamp  # noqa: E402

from opcontract.backends.registry import CallInfo, implementations, rejection  # noqa: E402
from opcontract.conformance.fuzz import fuzz  # noqa: E402
from opcontract.contracts import load_all  # noqa: E402
from opcontract.dispatch.device import device_of  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = device_of(torch.empty(0, device=args.device))
    rows, failed = [], 0
    for op, c in sorted(load_all().items()):
        for impl in implementations(op):
            if impl.relaxed_only:
                continue
            why = rejection(impl, c, CallInfo(dev, impl.dtypes[0], {}, {}), "strict")
            row = {"op": op, "implementation": impl.name, "calls": args.calls}
            if why:
                row["skipped"] = why
            else:
                t0 = time.time()
                try:
                    row.update(fuzz(op, impl.name, args.calls, args.device))
                except AssertionError as e:
                    row["failure"] = str(e)[:2000]
                    failed += 1
                row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {
        "benchmark": "fuzz_counts",
        "command": " ".join(["python", *sys.argv]),
        "env": env_stamp(),
        "rows": rows,
        "failed": failed,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
