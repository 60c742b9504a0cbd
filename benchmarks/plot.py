"""Plot a benchmark result file: time and peak extra memory against x, one line per provider.

python benchmarks/plot.py benchmarks/results/softcap_logprob_forward_h200.json out.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> int:
    data = json.loads(open(src).read())
    series: dict[str, list[dict]] = defaultdict(list)
    for row in data["rows"]:
        series[row["provider"]].append(row)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in series.items():
        rows.sort(key=lambda r: r["x"])
        xs = [r["x"] for r in rows]
        ax_t.plot(xs, [r["median"] for r in rows], marker="o", label=name)
        ax_m.plot(xs, [r["peak_extra_bytes"] / 2**30 for r in rows], marker="o", label=name)
    floor = sorted({(r["x"], r["gemm_floor_ms"]) for r in data["rows"]})
    ax_t.plot([x for x, _ in floor], [f for _, f in floor], "k--", label="GEMM floor")
    x_name = data["rows"][0]["x_name"]
    for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak extra memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log" if ax is ax_t else "linear")
        ax.set_xlabel(x_name)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_t.legend(fontsize=8)
    env = data["env"]
    fig.suptitle(
        f"{data['benchmark']} on {env['gpu']} (torch {env['torch']}, Triton {env['triton']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
