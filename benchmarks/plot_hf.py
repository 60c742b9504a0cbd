"""Plot Muse Glimmer's throughput in HF transformers (``hf_throughput_gpu.py`` results):
training tokens/s per sequence length and decode tokens/s per batch size, one bar per
provider (and decode cache mode), each file's rows as they were measured (a later file's
rows replace an earlier one's of the same provider, mode and size). Each panel names the
files its bars come from.

python benchmarks/plot_hf.py benchmarks/results/hf_throughput_h200.json \
    benchmarks/results/hf_decode_single_pass_h200.json docs/transformers_h200.png

Files with training rows only: the second panel is each step's peak memory instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(srcs: list[str]) -> dict:
    """(panel, series, size) -> (tokens/s, source file name), later files first."""
    out: dict = {}
    for src in srcs:
        for r in json.loads(Path(src).read_text())["rows"]:
            if "tokens_per_s" not in r:
                continue  # an error row
            if r["mode"] == "train":
                key = ("train", r["provider"], r["T"])
                out[("memory", r["provider"], r["T"])] = (r["peak_gb"], Path(src).name)
            else:
                cache = r.get("cache", "eager")
                key = ("decode", f"{r['provider']}, {cache}", r["B"])
            out[key] = (r["tokens_per_s"], Path(src).name)
    return out


def panel(ax, data: dict, part: str, xlabel: str, ylabel: str = "tokens/s") -> None:
    series = sorted({k[1] for k in data if k[0] == part})
    sizes = sorted({k[2] for k in data if k[0] == part})
    width = 0.8 / max(len(series), 1)
    for i, name in enumerate(series):
        xs, ys = [], []
        for j, n in enumerate(sizes):
            if (part, name, n) in data:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                ys.append(data[part, name, n][0])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    files = sorted({v[1] for k, v in data.items() if k[0] == part})
    ax.set_title(f"{part} ({', '.join(files)})", fontsize=8)
    ax.legend(fontsize=7)


def main(*paths: str) -> int:
    *srcs, dst = paths
    data = rows(srcs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    panel(axes[0], data, "train", "tokens per sequence (loss and backward)")
    if any(k[0] == "decode" for k in data):
        panel(axes[1], data, "decode", "batch (generate, 32 new tokens after 128)")
        axes[1].set_yscale("log")
        better = "higher is better"
    else:
        panel(axes[1], data, "memory", "tokens per sequence", "peak GB during a step")
        better = "tokens/s: higher is better; memory: lower"
    gpu = json.loads(Path(srcs[-1]).read_text()).get("env", {}).get("gpu", "GPU")
    fig.suptitle(f"Muse Glimmer, 4 layers at real width, bf16, {gpu}: {better}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print("wrote", dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
