"""Summary of the clock log run_h200.sh keeps beside its stages (nvidia-smi every 5 s):
samples under load, their SM clocks, and how many were slowed for heat or power. A run whose
busy samples were slowed gives times that compare with no other run.

    python benchmarks/clock_summary.py clocks.csv
"""

from __future__ import annotations

import csv
import statistics
import sys

# clocks_throttle_reasons bits that slow a busy GPU: SW power cap, HW slowdown, SW thermal,
# HW thermal, HW power brake
SLOWING = 0x04 | 0x08 | 0x20 | 0x40 | 0x80


def summarize(path: str) -> dict:
    busy, slowed, temps = [], 0, []
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
    return {
        "busy_samples": len(busy),
        "slowed_samples": slowed,
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
