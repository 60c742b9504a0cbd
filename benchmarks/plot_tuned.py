"""Plot a tuned_dispatch result: default time over tuned time against the batch size, one
panel per op, one line per implementation and shape.

python benchmarks/plot_tuned.py benchmarks/results/tuned_dispatch_h200.json docs/tuned_h200.png
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> int:
    data = json.loads(open(src).read())
    panels: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in data["rows"]:
        batch_dim = "M" if "M" in r["sizes"] else "T"
        shape = ",".join(f"{k}={v}" for k, v in sorted(r["sizes"].items()) if k != batch_dim)
        line = f"{r['implementation']} {shape}"
        panels[r["op"]][line].append((r["sizes"][batch_dim], r["speedup"], batch_dim))
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    for ax, (op, series) in zip(axes.flat, panels.items(), strict=False):
        for line, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=line)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(op, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(next(iter(series.values()))[0][2])
        ax.set_ylabel("default time / tuned time")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    env = data["env"]
    fig.suptitle(
        f"tuned vs default config on {env['gpu']} (torch {env['torch']}, Triton {env['triton']}, "
        f"commit {env.get('opcontract_commit')}); every row bitwise equal to the default",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
