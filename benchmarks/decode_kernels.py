"""GPU time per eager decode step of Muse Glimmer in HF transformers, by kernel, stock and
patched, beside the step's wall time.

    python benchmarks/decode_kernels.py --out results.json [--layers 4] [--batch 1,16]

(decode_kernels_h200.json was made before the walls were timed first: its walls, 1.5x
generate's own timing of the same steps, were likely inflated by the profiler that ran
before them in the same process; not measured apart.)

``torch.profiler`` records ``generate`` with 1 and with ``1 + steps`` new tokens; each
kernel's summed device time of the first is taken from the second's and divided by
``steps`` (prefill and the first token cancel). The wall time per step comes the same way
from unprofiled runs (median of 3). A step whose GPU time is well under its wall time is
bound by the host.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from hf_train_rollout_gpu import make_model, prompts  # noqa: E402


def kernel_us(fn) -> collections.Counter:
    """Device microseconds per kernel name over one call of ``fn``."""
    out: collections.Counter = collections.Counter()
    for name, us in common.kernel_us(fn, calls=1, warm=False).items():
        out[name[:90]] += us
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    from opcontract.integrations.transformers import apply_opcontract

    model = make_model(args.layers).eval()
    vocab = model.config.text_config.vocab_size
    rows = []
    for provider in ("stock (sdpa)", "opcontract"):
        if provider == "opcontract":
            apply_opcontract(model)
        for B in (int(b) for b in args.batch.split(",")):
            ids, mask = prompts([args.prompt] * B, vocab)

            def gen(n, ids=ids, mask=mask):
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False)  # fmt: skip

            gen(2)  # compile and warm up
            # walls first: a profiler session leaves host overhead behind in the process
            step_s = (common.wall_s(lambda: gen(1 + args.steps)) - common.wall_s(lambda: gen(1)))
            step_s /= args.steps
            one, more = kernel_us(lambda: gen(1)), kernel_us(lambda: gen(1 + args.steps))
            per = {k: (more[k] - one.get(k, 0)) / args.steps for k in more}
            per = dict(sorted(per.items(), key=lambda kv: -kv[1]))
            gpu_ms = sum(per.values()) / 1e3
            top = {k: round(v, 2) for k, v in list(per.items())[: args.top]}
            row = {
                "provider": provider,
                "batch": B,
                "prompt": args.prompt,
                "layers": args.layers,
                "wall_ms_per_step": step_s * 1e3,
                "gpu_kernel_ms_per_step": gpu_ms,
                "tokens_per_s": B / step_s,
                "top_kernels_us_per_step": top,
            }
            rows.append(row)
            print(f"{provider:14s} B={B:3d} wall {row['wall_ms_per_step']:.2f} ms/step, "
                  f"GPU kernels {gpu_ms:.2f} ms/step", flush=True)  # fmt: skip
            for k, v in list(per.items())[:8]:
                print(f"    {v:9.1f} us  {k}", flush=True)
    out = {
        "benchmark": "decode_kernels",
        "env": common.env_stamp(),
        "note": args.note,
        "rows": rows,
    }
    common.write(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
