"""Plot attention results: training TFLOP/s and decode bandwidth (as a fraction of the copy
rate) per provider. With several result files, a later file's rows replace an earlier one's
for the providers it has; a provider only an earlier file has (FA4) is kept from it.

python benchmarks/plot_attention.py benchmarks/results/attention_h200.json \
    benchmarks/results/attention_train_decode_h200.json \
    benchmarks/results/attention_decode_single_pass_table_h200.json docs/attention_h200.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _merged(srcs: list[str]) -> dict:
    data: dict = {"train": [], "decode": []}
    for src in srcs:
        d = json.loads(open(src).read())
        for part in ("train", "decode"):
            rows = [r for r in d.get(part, []) if isinstance(r, dict)]
            mine = {r["provider"] for r in rows}
            data[part] = [r for r in data[part] if r["provider"] not in mine] + rows
        data["env"] = d["env"]
    return data


def main(*paths: str) -> int:
    *srcs, dst = paths
    data = _merged(srcs)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, mode in zip(axes[:2], ("forward", "forward+backward"), strict=True):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in data["train"]:
            if r.get("mode") == mode and "tflops" in r:
                series[f"{r['provider']} ({r['layer']})"].append((r["L"], r["tflops"]))
        for name, pts in sorted(series.items()):
            pts.sort()
            style = "--" if "local" in name else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("L (16384 tokens a call)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"training {mode}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    series = defaultdict(list)
    for r in data["decode"]:  # a row that failed has no of_copy: its point is left out
        if "of_copy" in r and r["L"] in (8192, 32768):
            name = r["provider"].split(" (")[0].replace("split=-1", "default")
            if name in ("opcontract default", "fa4", "sdpa", "opcontract split=0"):
                series[f"{name}, L = {r['L']}"].append((r["B"], r["of_copy"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        style = "--" if name.endswith("8192") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch B (global layer)")
    ax.set_ylabel("K/V bytes read / time, fraction of copy rate")
    ax.set_title("decode (graph replay)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    env = data["env"]
    fig.suptitle(f"gated attention, GQA 32/2, head_dim 128, bf16 — {env['gpu']}, torch "
                 f"{env['torch']}, triton {env['triton']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
