"""Tensor-parallel invariance on gloo CPU processes: one training step of the tiny random
Muse Glimmer (the real layer schedule) at TP 1, 2 and 4, strict styles (the LM head
replicated, or vocabulary-parallel) and the stock all-reduce control, mismatch counts
against one rank, and the step time. ``--tp8``: TP 8 only, on the tiny model with 8 query
heads (each KV head replicated by 4 ranks).

    python benchmarks/tp_invariance_cpu.py --out benchmarks/results/tp_invariance_cpu.json
    python benchmarks/tp_invariance_cpu.py --tp8 --out benchmarks/results/tp8_invariance_cpu.json
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--tp8",
        action="store_true",
        help="only TP 8 (8 query heads on 2 KV heads, KV replicated by 4 ranks)",
    )
    args = ap.parse_args()
    rows = []
    heads = 8 if args.tp8 else 4
    runs = (
        ("replicate", 97, 2, {}), ("replicate", 97, 4, {"kv_policy": "replicate"}),
        ("replicate", 97, 2, {"combine": "all_reduce"}),
        ("vocab", 104, 2, {}), ("vocab", 104, 4, {"kv_policy": "replicate"}),
    )  # fmt: skip
    if args.tp8:
        runs = (("replicate", 97, 8, {"kv_policy": "replicate"}),
                ("vocab", 104, 8, {"kv_policy": "replicate"}))  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        refs = {}
        for head, vocab in (("replicate", 97), ("vocab", 104)):
            tree1 = selfcheck.step(None, dtype, vocab=vocab, head=head, heads=heads)
            plain = selfcheck.step(None, dtype, vocab=vocab, shard=False, heads=heads)
            refs[head] = tree1, plain
            moved = sum(selfcheck.mismatches(tree1, plain).values())
            rows.append(dict(
                dtype=str(dtype), head=head, vocab=vocab, degree=1, form="segmented (one rank)",
                seconds=tree1["seconds"], plain_seconds=plain["seconds"], mismatches_vs_plain=moved,
            ))  # fmt: skip
        for head, vocab, world, kw in runs:
            tree1, plain = refs[head]
            with tempfile.TemporaryDirectory() as d:
                res = selfcheck.run(world, d, dtype, vocab=vocab, head=head, heads=heads, **kw)
            ref = plain if kw.get("combine") == "all_reduce" else tree1
            per_rank = [selfcheck.mismatches(r, ref) for r in res]
            rows.append(dict(
                dtype=str(dtype), head=head, vocab=vocab, degree=world, query_heads=heads,
                form=kw.get("combine", "tree"), kv_policy=kw.get("kv_policy", "split"),
                compared_with="unsharded patched model" if ref is plain else "one-rank tree",
                tensors=2 + len(ref["grads"]),
                mismatched_tensors=[len(m) for m in per_rank],
                mismatched_elements=[sum(m.values()) for m in per_rank],
                seconds=[r["seconds"] for r in res],
            ))  # fmt: skip
            print(rows[-1], flush=True)
    common.write(args.out, dict(benchmark="tp_invariance_cpu", env=common.env_stamp(), rows=rows))


if __name__ == "__main__":
    main()
