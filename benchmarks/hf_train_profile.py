"""Where a training step's GPU time goes: Muse Glimmer at real width in HF transformers, one
``model(input_ids, labels=input_ids).loss.backward()`` step, profiled (torch.profiler), the
CUDA kernel time summed by kernel name, per provider (as hf_throughput_gpu.py builds them).

    python benchmarks/hf_train_profile.py --out results.json [--T 8192] [--layers 4] \
        [--providers opcontract,liger] [--top 25]

Each row: the step's wall time (synchronised), the total kernel time, and the ``top``
kernels by time (ms per step, calls per step), the rest summed as ``other``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from hf_throughput_gpu import PROVIDERS, provider_model  # noqa: E402


def profile_step(model, T: int, vocab: int, top: int, runs: int = 2) -> dict:
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.randint(3, vocab, (1, T), device="cuda", generator=g)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: compiles, autotunes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    ms: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[e.name[:120]] += e.device_time / 1e3 / runs
            calls[e.name[:120]] += 1 / runs
    total = sum(ms.values())
    kernels = {k: {"ms": round(v, 3), "calls": round(calls[k], 1)} for k, v in ms.most_common(top)}
    kernels["other"] = {"ms": round(total - sum(v["ms"] for v in kernels.values()), 3)}
    return dict(T=T, wall_ms=wall * 1e3, kernel_ms=total, kernels=kernels)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--providers", default="opcontract,liger")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    payload = {"benchmark": "hf_train_profile", "env": common.env_stamp(), "layers": a.layers,
               "note": a.note, "rows": []}  # fmt: skip
    model = None
    for provider in a.providers.split(","):
        model = provider_model(provider, model, a.layers)
        if model is None:
            payload["rows"].append(dict(provider=provider, error="unavailable"))
            continue
        model.train()
        row = profile_step(model, a.T, model.config.text_config.vocab_size, a.top)
        row["provider"] = PROVIDERS[provider]
        payload["rows"].append(row)
        print(row["provider"], f"wall {row['wall_ms']:.1f} ms kernels {row['kernel_ms']:.1f} ms")
        for k, v in row["kernels"].items():
            print(f"  {v['ms']:8.2f} ms {v.get('calls', ''):>6} {k[:100]}")
        common.write(a.out, payload)
        torch.cuda.empty_cache()
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
