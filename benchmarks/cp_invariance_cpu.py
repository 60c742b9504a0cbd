"""Context-parallel invariance on gloo CPU processes: one training step of the tiny random
Muse Glimmer (the real layer schedule, a left-padded batch of lengths 7, 5, 9) with its
sequences split over 2 ranks (and 4, lengths 7, 5, 13), against the unsharded patched
model: mismatch counts for the strict form and for the collective-sum control, the
control's largest relative error, and the step time.

    python benchmarks/cp_invariance_cpu.py --out benchmarks/results/cp_invariance_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from opcontract.parallel import selfcheck  # noqa: E402


def _worst_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for n, g in b["grads"].items():
        d, ref = a["grads"][n].double() - g.double(), g.double()
        worst = max(worst, float(d.norm() / ref.norm().clamp(min=1e-300)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    runs = ((2, None, "tree"), (2, None, "all_reduce"), (4, [7, 5, 13], "tree"))
    for dtype in (torch.float32, torch.bfloat16):
        ones = {}
        for world, lengths, combine in runs:
            key = tuple(lengths or selfcheck.STEP_LENGTHS)
            if key not in ones:
                ones[key] = selfcheck.step(None, dtype, shard=False, lengths=list(key))
            one = ones[key]
            with tempfile.TemporaryDirectory() as d:
                res = selfcheck.run(world, d, dtype, context=True, combine=combine,
                                    lengths=list(key))  # fmt: skip
            per_rank = [selfcheck.mismatches(r, one) for r in res]
            rows.append(dict(
                dtype=str(dtype), degree=world, lengths=list(key), combine=combine,
                form=res[0]["provenance"]["backward"], compared_with="unsharded patched model",
                tensors=2 + len(one["grads"]),
                mismatched_tensors=[len(m) for m in per_rank],
                mismatched_elements=[sum(m.values()) for m in per_rank],
                forward_equal=[("loss" not in m and "logprobs" not in m) for m in per_rank],
                worst_grad_rel_error=max(_worst_rel(r, one) for r in res),
                seconds=[r["seconds"] for r in res], one_rank_seconds=one["seconds"],
            ))  # fmt: skip
            print(rows[-1], flush=True)
    common.write(args.out, dict(benchmark="cp_invariance_cpu", env=common.env_stamp(), rows=rows))


if __name__ == "__main__":
    main()
