"""Plot a tuned_dispatch result: default time over tuned time against the batch size, one
panel per op, one line per implementation and shape.

python benchmarks/plot_tuned.py benchmarks/results/tuned_dispatch_h200.json docs/tuned_h200.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from plot_rates import draw_panels


def main(src: str, dst: str) -> int:
    data = json.loads(open(src).read())
    panels: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    xlabel: dict[str, str] = {}
    for r in data["rows"]:
        batch_dim = "M" if "M" in r["sizes"] else "T"
        shape = ",".join(f"{k}={v}" for k, v in sorted(r["sizes"].items()) if k != batch_dim)
        line = f"{r['implementation']} {shape}"
        panels[r["op"]][line].append((r["sizes"][batch_dim], r["speedup"]))
        xlabel[r["op"]] = batch_dim
    env = data["env"]
    draw_panels(
        panels,
        dst,
        xlabel=xlabel,
        ylabel="default time / tuned time",
        title=f"tuned vs default config on {env['gpu']} (torch {env['torch']}, "
        f"Triton {env['triton']}, commit {env.get('opcontract_commit')}); every row bitwise "
        "equal to the default",
        cols=2,
        panel_size=(6, 3.8),
        legend_size=6,
        hline=1.0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
