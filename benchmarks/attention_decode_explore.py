"""Decode configurations of the Triton gated_attention on the GPU: graph-replayed time and
KV-read bandwidth of every (split, block_m, num_warps, num_stages), each output checked
bitwise against the training configuration's (block_m 128, two stages, fused) on the same
inputs, with each compiled kernel's registers, spills and shared memory.

    python benchmarks/attention_decode_explore.py --out benchmarks/results/X.json \
        [--B 1,8,64,256] [--L 8192,32768] [--block-m 16,64] [--interior 0,1] \
        [--before MODULE] [--kernel-us]

``--before``: a module holding an earlier ``gated_attention_kernels`` (e.g. ``git show
REV:opcontract/backends/triton/gated_attention_kernels.py > benchmarks/_kernels_before.py``,
then ``--before _kernels_before``): the reference is then its training configuration, so
every row also says whether the current kernels keep the earlier bits.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HQ, HKV, D = 32, 2, 128
TRAINING = {"split": 0, "block_m": 128, "num_warps": 8, "num_stages": 2}


def inputs(B: int, L: int):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(B + L)
    k = torch.randn(B * L, HKV, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, D, device=dev, generator=g, dtype=torch.bfloat16)
    gate = torch.randn_like(q)
    ar = torch.arange(L // 128, device=dev)
    table = torch.arange(B, device=dev)[:, None] * L + 128 * ar[None]
    key_len = torch.full((B,), L, device=dev)
    # positions spread below L so that tiles see different numbers of chunks
    pos = key_len - 1 - torch.randint(0, 1000, (B,), device=dev, generator=g)
    return q, k, v, gate, pos, torch.arange(B, device=dev), table, key_len


def decode_fn(cfg: dict, q, k, v, gate, pos, seq, table, key_len):
    """(fn, out, lse, plan): one decode call of the Triton gated_attention planned with
    ``cfg`` (a global layer), ``fn`` launching its kernels into out / lse."""
    from opcontract.backends.triton import gated_attention as tga

    out = torch.empty_like(q)
    attn = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    plan = tga.plan_forward(cfg, q, k, pos, seq, table, layer="global", window=None, scale=None)

    def fn():
        tga.run_forward(plan, q, k, v, gate, pos, table, key_len, out, attn, lse)

    return fn, out, lse, plan


def kernels_seen() -> list[dict]:
    from opcontract.backends.triton import launch

    out = []
    for kernel, compiled, *_ in launch._COMPILED.values():
        out.append(dict(kernel=kernel.fn.__name__, n_regs=getattr(compiled, "n_regs", None),
                        n_spills=getattr(compiled, "n_spills", None),
                        shared=getattr(compiled.metadata, "shared", None),
                        num_warps=compiled.metadata.num_warps,
                        num_stages=compiled.metadata.num_stages))  # fmt: skip
    return out


def shape_rows(B: int, L: int, copy: float, a, payload: dict) -> None:
    import opcontract.backends.triton as tpkg
    from opcontract.backends.triton import gated_attention_kernels as now
    from opcontract.backends.triton import launch

    q, k, v, gate, pos, seq, table, key_len = inputs(B, L)
    nbytes = 2 * B * L * HKV * D * 2

    def run(cfg):
        fn, out, lse, plan = decode_fn(cfg, q, k, v, gate, pos, seq, table, key_len)
        fn()
        return fn, out, lse, plan

    if a.before:  # what the host wrapper imports at each launch
        launch.clear()
        tpkg.gated_attention_kernels = importlib.import_module(a.before)
    try:
        _, ref_out, ref_lse, _ = run(TRAINING)
        ref_out, ref_lse = ref_out.clone(), ref_lse.clone()
    finally:
        tpkg.gated_attention_kernels = now
    grid = [{"split": split, "block_m": bm, "num_warps": w, "num_stages": st, "interior": inner,
             "merge_in": mi, "merge_stages": ms, "merge_ahead": ma, "rows_first": rf,
             "merge_cols": mc, "merge_warps": mw}
            for split, bm, w, st, inner, mi, ms, ma, rf, mc, mw in itertools.product(
                map(int, a.split.split(",")), map(int, a.block_m.split(",")),
                map(int, a.warps.split(",")), map(int, a.stages.split(",")),
                map(int, a.interior.split(",")), map(int, a.merge_in.split(",")),
                map(int, a.merge_stages.split(",")),
                map(int, a.merge_ahead.split(",")),
                map(int, a.rows_first.split(",")), map(int, a.merge_cols.split(",")),
                map(int, a.merge_warps.split(",")))]  # fmt: skip
    for cfg in ([dict(TRAINING)] if a.before else []) + grid:
        row = dict(B=B, L=L, **cfg)  # (with --before, the first row: the training config)
        try:
            launch.clear()
            fn, out, lse, plan = run(cfg)
            torch.cuda.synchronize()
            row["bits_equal"] = bool(torch.equal(out, ref_out) and torch.equal(lse, ref_lse))
            row["differ_rows"] = int((out != ref_out).any(-1).sum())
            row["differ_lse"] = int((lse != ref_lse).sum())
            ms = common.bench_graph(fn, rep_ms=60)
            row.update(ms=ms, gbps=nbytes / ms / 1e6, of_copy=nbytes / ms / 1e6 / copy,
                       fused=not plan.split)  # fmt: skip
            if a.kernel_us:  # GPU time per call by kernel (the chunks, the merge)
                row["kernel_us"] = {k: round(v, 2) for k, v in
                                    common.kernel_us(fn, calls=20).items()}  # fmt: skip
            payload["kernels"][str(cfg)] = kernels_seen()
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        payload["rows"].append(row)
        print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", default="1,8,64,256")
    ap.add_argument("--L", default="8192,32768")
    ap.add_argument("--block-m", default="16,64")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--split", default="0,1")
    ap.add_argument("--interior", default="0")
    ap.add_argument("--merge-in", default="0", help="split decode's merge in the chunk kernel")
    ap.add_argument("--merge-stages", default="1", help="the merge kernel's pipeline stages")
    ap.add_argument("--merge-ahead", default="0", help="the merge reads four chunks, eight ahead")
    ap.add_argument("--rows-first", default="0", help="a chunk's block rows read first")
    ap.add_argument("--merge-cols", default="32", help="channels a merge program takes")
    ap.add_argument("--merge-warps", default="2", help="the merge kernel's warps")
    ap.add_argument("--note", default="", help="recorded in the JSON (e.g. the tree run)")
    ap.add_argument("--before", default=None, help="earlier kernels' module: the reference")
    ap.add_argument("--kernel-us", action="store_true", help="GPU time per call by kernel")
    a = ap.parse_args()
    copy = common.copy_gbps()
    payload = {"benchmark": "attention_decode_explore", "env": common.env_stamp(),
               "ceilings": {"copy_gbps": copy}, "reference_config": TRAINING,
               "reference_kernels": a.before or "current",
               "command": " ".join(["python", *sys.argv]),
               "rows": [], "kernels": {}, "note": a.note}  # fmt: skip
    t0 = time.time()
    for L, B in itertools.product(map(int, a.L.split(",")), map(int, a.B.split(","))):
        shape_rows(B, L, copy, a, payload)
        torch.cuda.empty_cache()
        common.write(a.out, payload)
    payload["seconds"] = round(time.time() - t0, 1)
    common.write(a.out, payload)


if __name__ == "__main__":
    main()
