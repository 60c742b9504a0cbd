"""Where the GPU time of ``generate()`` goes, kernel by kernel: stock and patched Muse Glimmer
at real width, eager and static cache (torch.compile, CUDA graphs), on the GPU.

    python benchmarks/decode_gpu_profile.py --out results.json [--batch 1,64] [--layers 4]

Per (provider, cache mode, batch): one untimed ``generate`` (compiles), then one under
``torch.profiler`` (CPU and CUDA activity; kernels replayed from a CUDA graph are recorded
too). The same call as ``hf_throughput_gpu.py``'s decode rows: a prompt of 128 random
tokens, 32 greedy new tokens. Reported: the call's wall time, the sum of its kernels' GPU
time, and the kernels grouped by name (GPU microseconds, calls), the largest first, each
with a coarse class (matmul, attention, norm, lm head, other) read from its name.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from hf_throughput_gpu import decode_inputs, provider_model  # noqa: E402

CLASSES = (  # (class, substrings of a kernel name), first match wins
    ("lm head", ("softcap", "logprob", "logits", "lse")),
    ("attention", ("attn", "attention", "flash", "fmha", "sdpa", "softmax")),
    ("norm", ("rms", "norm", "rope")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "matmul", "mm_")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile_row(model, B: int, vocab: int, cache: str, new: int, top: int) -> dict:
    ids, kw = decode_inputs(B, vocab, new, cache)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad():
        model.generate(ids, **kw)
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.time_range.elapsed_us()
            per[ev.name][1] += 1
    kernels = sorted(((n, us, c) for n, (us, c) in per.items()), key=lambda x: -x[1])
    by_class: collections.Counter = collections.Counter()
    for n, us, _ in kernels:
        by_class[kernel_class(n)] += us
    total = sum(us for _, us, _ in kernels)
    return dict(B=B, cache=cache, new_tokens=new, wall_s=wall, gpu_kernel_us=total,
                by_class_us=dict(by_class.most_common()),
                kernels=[dict(name=n[:160], us=us, calls=c, cls=kernel_class(n))
                         for n, us, c in kernels[:top]])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--modes", default="eager,static")
    ap.add_argument("--providers", default="stock,opcontract")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--note", default="", help="e.g. the tree the run measured")
    a = ap.parse_args()
    import transformers

    payload = {"benchmark": "decode_gpu_profile", "env": common.env_stamp(),
               "transformers": transformers.__version__, "layers": a.layers, "note": a.note,
               "rows": []}  # fmt: skip
    model = None
    for provider in a.providers.split(","):
        model = provider_model(provider, model, a.layers)
        model.eval()
        vocab = model.config.text_config.vocab_size
        for mode in a.modes.split(","):
            for b in a.batch.split(","):
                try:
                    row = profile_row(model, int(b), vocab, mode, a.new, a.top)
                except Exception as e:  # noqa: BLE001
                    row = dict(B=int(b), cache=mode, error=f"{type(e).__name__}: {e}"[:600])
                row["provider"] = provider
                payload["rows"].append(row)
                short = {k: v for k, v in row.items() if k != "kernels"}
                print(short, flush=True)
                for k in row.get("kernels", [])[:8]:
                    print(f"    {k['us']:10.0f} us {k['calls']:6d}x {k['cls']:9s} {k['name'][:90]}")
                common.write(a.out, payload)
                torch.cuda.empty_cache()
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
