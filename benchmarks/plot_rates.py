"""Plot rates from a result file, one panel per kernel, one line per provider.

python benchmarks/plot_rates.py benchmarks/results/dense_gemm_h200.json docs/dense_gemm_h200.png
python benchmarks/plot_rates.py benchmarks/results/memory_bound_ops_h200.json docs/mem.png
python benchmarks/plot_rates.py benchmarks/results/memory_bound_ops_h200.json b.png fwd+bwd.graph

dense_gemm: TFLOP/s against M. memory_bound_ops: bandwidth as a fraction of the copy rate
measured in the same run, against T. The rows of one mode are drawn (default "forward").
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def draw_panels(
    panels: dict[str, dict[str, list[tuple[float, float]]]],
    dst: str,
    *,
    xlabel: dict[str, str],
    ylabel: str,
    title: str,
    cols: int,
    panel_size: tuple[float, float] = (5, 3.6),
    legend_size: int = 7,
    hline: float | None = None,
) -> None:
    """One panel per key of ``panels`` (x on a log2 axis labelled ``xlabel[key]``), one line
    per series of (x, y) points; written to ``dst``."""
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows), squeeze=False
    )
    for ax, (name, series) in zip(axes.flat, panels.items(), strict=False):
        for label, pts in series.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        if hline is not None:
            ax.axhline(hline, color="grey", linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel[name])
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=legend_size)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


def main(src: str, dst: str, mode: str = "forward") -> int:
    data = json.loads(open(src).read())
    gemm = data["benchmark"] == "dense_gemm"
    key, ylabel = ("tflops", "TFLOP/s") if gemm else ("fraction_of_copy", "fraction of copy rate")
    panels: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in data["rows"]:
        if r.get(key) is not None and r.get("mode") == mode:
            panels[r["kernel"]][r["provider"]].append((r["x"], r[key]))
    env = data["env"]
    draw_panels(
        panels,
        dst,
        xlabel={k: data["rows"][0]["x_name"] for k in panels},
        ylabel=ylabel,
        title=f"{data['benchmark']} {mode} on {env['gpu']} (torch {env['torch']}, "
        f"Triton {env['triton']}, commit {env.get('opcontract_commit')})",
        cols=2 if gemm else 3,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
