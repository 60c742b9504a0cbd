"""Plot a segmented_gemm_gpu result: each provider's time over dense_gemm's Triton time
against the token count, one panel per projection case.

    cd benchmarks
    python plot_segmented.py results/segmented_gemm_h200.json ../docs/segmented_gemm_h200.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from plot_rates import draw_panels

BASE = "dense_gemm (triton)"


def main(src: str, dst: str) -> int:
    data = json.loads(open(src).read())
    panels: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in data["rows"]:
        for provider, ms in r["ms"].items():
            if provider != BASE:
                panels[r["case"]][provider].append((r["M"], ms / r["ms"][BASE]))
    env = data["env"]
    draw_panels(
        panels,
        dst,
        xlabel={k: "M (tokens)" for k in panels},
        ylabel="time / dense_gemm (Triton) time",
        title=f"tensor parallelism's segmented form at TP 1 on {env['gpu']} (torch "
        f"{env['torch']}, Triton {env['triton']}); the shards of t = 2, 4, 8 bitwise equal",
        cols=2,
        panel_size=(6, 3.8),
        legend_size=6,
        hline=1.0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
