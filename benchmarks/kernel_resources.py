"""Registers, stack (spill) bytes and local-memory instructions of the Triton gated_attention
kernels compiled for sm_90, on any machine (no GPU: Triton compiles for the target it is told,
its bundled cuobjdump reads the cubin).

    python benchmarks/kernel_resources.py --out results.json [--tree DIR --label NAME ...] \
        [--backward]

Each ``--tree`` is a checkout whose ``opcontract`` is compiled (default: this one), by
``sm90_compile.compile_attention`` (a real launch's hints at Muse Glimmer's geometry).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402

CASES = [  # (kernel, constexprs, num_warps, num_stages[, maxnreg]): the defaults' launches
    # split decode's chunk programs (16-row tiles, block rows first): two stages, three where
    # they fit one an SM; then its merge (8 and 32 channels, reading ahead)
    ("_attn_chunk_kernel", dict(BLOCK_M=16, INTERIOR=True, ROWS_FIRST=1), 4, 2),
    ("_attn_chunk_kernel", dict(BLOCK_M=16, INTERIOR=True, ROWS_FIRST=1), 4, 3),
    ("_attn_chunk_kernel", dict(BLOCK_M=16, INTERIOR=True, ROWS_FIRST=1), 4, 2, 128),  # capped
    ("_attn_merge_kernel", dict(BLOCK_M=16, ROWS=16, COLS=8, AHEAD=True), 2, 1),
    ("_attn_merge_kernel", dict(BLOCK_M=16, ROWS=16, COLS=32, AHEAD=True), 2, 1),
    ("_attn_fwd_kernel", dict(BLOCK_M=128, SAFE=False, INTERIOR=True, REG_O=True), 8, 2),
    ("_attn_fwd_kernel", dict(BLOCK_M=128, SAFE=True, INTERIOR=True), 8, 1),  # its SAFE pass
]
BACKWARD_CASES = [  # the backward's kernels: the defaults from 1024 rows and the options
    ("_attn_bwd_dq_kernel", dict(BLOCK_M=64), 8, 1),  # before: 64 rows, one stage
    ("_attn_bwd_dq_kernel", dict(BLOCK_M=128), 8, 2),
    ("_attn_bwd_dkv_kernel", dict(KEYS=128), 8, 1),  # before: one stage
    ("_attn_bwd_dkv_kernel", dict(KEYS=128), 8, 2),
    ("_attn_bwd_dkv_kernel", dict(KEYS=64), 8, 1),
    ("_attn_bwd_dkv_kernel", dict(KEYS=64), 8, 2),
    ("_attn_bwd_dkv_kernel", dict(KEYS=128, TRANS=True), 8, 2),
    ("_attn_bwd_dkv_kernel", dict(KEYS=64, TRANS=True), 8, 2),
    ("_attn_bwd_dkv_kernel", dict(KEYS=64), 4, 2),
]

_CHILD = r"""
import json, os, re, subprocess, sys, tempfile
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # the tree's opcontract, this folder's helper
import triton
from sm90_compile import compile_attention
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
rows = []
for kernel, consts, warps, stages, *cap in json.loads(sys.argv[3]):
    k, consts = compile_attention(kernel, consts, warps, stages, *cap)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    use = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", use.stdout)
    shown = {n: consts[n] for n in ("BLOCK_M", "INTERIOR", "SAFE", "KEYS", "TRANS", "REG_O",
                                    "ROWS_FIRST", "COLS", "AHEAD")
             if n in consts}
    rows.append(dict(kernel=kernel, constexprs=shown, maxnreg=cap[0] if cap else None,
                     num_warps=warps, num_stages=stages, registers=int(m.group(1)),
                     stack_bytes=int(m.group(2)), STL=len(re.findall(r"\bSTL", sass)),
                     LDL=len(re.findall(r"\bLDL", sass))))
print(json.dumps(rows))
"""


def measure(tree: str, cases: list) -> list[dict]:
    env = {**os.environ, "TRITON_CACHE_DIR": f"/tmp/kernel_resources_{abs(hash(tree))}"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-c", _CHILD, tree, str(HERE), json.dumps(cases)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tree", action="append", default=None, help="a checkout (repeatable)")
    ap.add_argument("--label", action="append", default=None, help="a name for each --tree")
    ap.add_argument("--note", default="")
    ap.add_argument("--backward", action="store_true", help="the backward's kernels")
    a = ap.parse_args()
    trees = a.tree or [str(Path(__file__).resolve().parent.parent)]
    labels = a.label or [Path(t).name for t in trees]
    rows = []
    for label, tree in zip(labels, trees, strict=True):
        for r in measure(tree, BACKWARD_CASES if a.backward else CASES):
            rows.append(dict(tree=label, **r))
            print(rows[-1], flush=True)
    common.write(a.out, {"benchmark": "kernel_resources", "env": common.env_stamp(),
                         "command": " ".join(["python", *sys.argv]), "note": a.note,
                         "target": "sm_90", "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
