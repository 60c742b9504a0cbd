"""Summary of the clock log run_h200.sh keeps beside its stages (nvidia-smi every 5 s):
samples under load, their SM clocks, how many were slowed for heat (or by the hardware's own
slowdown) and how many ran at the power cap. A run slowed for heat gives times that compare
with no other run; the power cap is the GPU's steady state under heavy GEMMs.

    python benchmarks/clock_summary.py clocks.csv
"""

from __future__ import annotations

import csv
import statistics
import sys

# clocks_throttle_reasons bits: HW slowdown, SW thermal, HW thermal, HW power brake (a
# machine that can't hold its clocks), and the SW power cap
SLOWING = 0x08 | 0x20 | 0x40 | 0x80
POWER_CAP = 0x04


def summarize(path: str) -> dict:
    busy, slowed, capped, temps = [], 0, 0, []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 6:
                continue
            try:
                sm = float(row[1].split()[0])
                reasons = int(row[5].strip(), 16)
                temps.append(float(row[3]))
            except ValueError:
                continue
            if reasons & 0x01:  # idle
                continue
            busy.append(sm)
            slowed += bool(reasons & SLOWING)
            capped += bool(reasons & POWER_CAP)
    return {
        "busy_samples": len(busy),
        "slowed_samples": slowed,
        "power_capped_samples": capped,
        "median_busy_sm_mhz": statistics.median(busy) if busy else None,
        "max_temperature_c": max(temps) if temps else None,
    }


def main() -> int:
    s = summarize(sys.argv[1])
    print(f"== clocks: {s}")
    if s["slowed_samples"]:
        n, of = s["slowed_samples"], s["busy_samples"]
        print(f"== WARNING: the GPU slowed itself in {n} of {of} busy samples: times compare "
              "with no other run")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
