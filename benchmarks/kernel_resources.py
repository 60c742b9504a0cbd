"""Registers, stack (spill) bytes and local-memory instructions of the Triton gated_attention
kernels compiled for sm_90, on any machine (no GPU: Triton compiles for the target it is told,
its bundled cuobjdump reads the cubin).

    python benchmarks/kernel_resources.py --out results.json [--tree DIR --label NAME ...]

Each ``--tree`` is a checkout whose ``opcontract`` is compiled (default: this one); the
kernels get the launch's 16-byte divisibility hints (pointers, Hq, G, D, window), so the
figures are those of a real launch at Muse Glimmer's geometry (bf16, head_dim 128).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

P, F, I32 = "*bf16", "*fp32", "*i32"
_INDEX = dict(positions_ptr=I32, block_rows_ptr=I32, key_len_ptr=I32, tile_ptr=I32)
_SIZES = dict(T="i32", N="i32", Hq="i32", Hkv="i32", G="i32", D="i32", NB="i32")
SIGNATURES = {
    "_attn_chunk_kernel": dict(q_ptr=P, k_ptr=P, v_ptr=P, **_INDEX, part_m_ptr=F, part_l_ptr=F,
                               part_o_ptr=F, **_SIZES, NC="i32", window="i32", c="fp32"),
    "_attn_fwd_kernel": dict(q_ptr=P, k_ptr=P, v_ptr=P, gate_ptr=P, **_INDEX, out_ptr=P,
                             attn_ptr=F, lse_ptr=F, go_ptr=I32, redo_ptr=I32, **_SIZES,
                             window="i32", c="fp32"),
}  # fmt: skip
BASE = dict(LOCAL=False, INTERPRET=False, IEEE=False, BLOCK=128, BLOCK_D=128, CHUNK_BLOCKS=4)
CASES = [  # (kernel, constexprs, num_warps, num_stages): the defaults' launches
    ("_attn_chunk_kernel", dict(BLOCK_M=64, INTERIOR=True), 4, 1),  # split decode, B >= 8
    ("_attn_chunk_kernel", dict(BLOCK_M=64, INTERIOR=True), 4, 2),  # split decode, B = 1
    ("_attn_fwd_kernel", dict(BLOCK_M=128, SAFE=False, INTERIOR=True), 8, 2),  # training
    ("_attn_fwd_kernel", dict(BLOCK_M=128, SAFE=True, INTERIOR=True), 8, 1),  # its SAFE pass
]

_CHILD = r"""
import importlib, inspect, json, os, re, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[2])
mod = importlib.import_module("opcontract.backends.triton.gated_attention_kernels")
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
rows = []
for kernel, consts, warps, stages in spec["cases"]:
    fn = getattr(mod, kernel)
    sig = dict(spec["signatures"][kernel])
    consts = {**spec["base"], **consts}
    for n, p in inspect.signature(fn.fn).parameters.items():
        if n not in sig:
            sig[n] = "constexpr"
            consts.setdefault(n, p.default)
    hinted = [n for n, t in sig.items() if t.startswith("*") or n in ("Hq", "G", "D", "window")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    use = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", use.stdout)
    shown = {n: consts[n] for n in ("BLOCK_M", "INTERIOR", "SAFE") if n in consts}
    rows.append(dict(kernel=kernel, constexprs=shown,
                     num_warps=warps, num_stages=stages, registers=int(m.group(1)),
                     stack_bytes=int(m.group(2)), STL=len(re.findall(r"\bSTL", sass)),
                     LDL=len(re.findall(r"\bLDL", sass))))
print(json.dumps(rows))
"""


def measure(tree: str) -> list[dict]:
    spec = dict(cases=CASES, signatures=SIGNATURES, base=BASE)
    env = {**os.environ, "TRITON_CACHE_DIR": f"/tmp/kernel_resources_{abs(hash(tree))}"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", _CHILD, tree, json.dumps(spec)], env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tree", action="append", default=None, help="a checkout (repeatable)")
    ap.add_argument("--label", action="append", default=None, help="a name for each --tree")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    trees = a.tree or [str(Path(__file__).resolve().parent.parent)]
    labels = a.label or [Path(t).name for t in trees]
    rows = []
    for label, tree in zip(labels, trees, strict=True):
        for r in measure(tree):
            rows.append(dict(tree=label, **r))
            print(rows[-1], flush=True)
    common.write(a.out, {"benchmark": "kernel_resources", "env": common.env_stamp(),
                         "command": " ".join(["python", *sys.argv]), "note": a.note,
                         "target": "sm_90", "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
