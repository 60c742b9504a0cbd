"""sm_90 PTX of the Triton kernels whose source a change touched, compiled from two checkouts
(no GPU needed: Triton compiles for a target it is told), compared with debug lines removed.

    python benchmarks/ptx_compare.py OLD_TREE NEW_TREE --out results.json

Each spec is a kernel at Muse Glimmer's sizes (H = 6656, bf16) with the constexprs and launch
options the host code gives it. A kernel may live in another module in each tree (a rename),
and a constexpr the old tree lacks is left out there when it holds its default (the new
specialization is then the old one, if the change added nothing else). The report gives, per
spec, whether the two PTX texts are equal and, if not, the differing lines.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

B, F, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
_NORM_FWD = dict(H="i32", stride="i32", eps="fp32")
SPECS = [
    *(
        dict(
            name=f"rms_fwd variant {v} w_first {wf}",
            module=(
                "opcontract.backends.triton.norms_kernels",
                "opcontract.backends.triton.rms_norm_kernels",
            ),
            kernel="_rms_fwd_kernel",
            signature=dict(x_ptr=B, w_ptr=B, y_ptr=B, rstd_ptr=F, **_NORM_FWD),
            constexprs=dict(VARIANT=v, BLOCK_H=8192, W_FIRST=wf),
            new_only=dict(STORE_RSTD=True),
            options=dict(num_warps=8),
        )
        for v in (0, 1, 2)
        for wf in (True, False)
    ),
    *(
        dict(
            name=f"add_rms_fwd variant {v} w_first {wf}",
            module=(
                "opcontract.backends.triton.norms_kernels",
                "opcontract.backends.triton.rms_norm_kernels",
            ),
            kernel="_add_rms_fwd_kernel",
            signature=dict(x_ptr=B, r_ptr=B, w_ptr=B, y_ptr=B, rout_ptr=B, rstd_ptr=F, **_NORM_FWD),
            constexprs=dict(VARIANT=v, BLOCK_H=8192, W_FIRST=wf),
            new_only=dict(STORE_RSTD=True),
            options=dict(num_warps=8),
        )
        for v in (0, 1, 2)
        for wf in (True, False)
    ),
    *(
        dict(
            name=f"softcap partials cap {cap} entropy {ent} argmax {arg}",
            module=("opcontract.backends.triton.softcap_logprob_kernels",) * 2,
            kernel="_partials_kernel",
            signature=dict(
                h_ptr=B,
                w_ptr=B,
                t_ptr=I64,
                pmax_ptr=F,
                psum_ptr=F,
                pzs_ptr=F,
                parg_ptr=I32,
                pzsum_ptr=F,
                zt_ptr=F,
                T="i32",
                V="i32",
                H="i32",
                stride_h="i32",
                stride_w="i32",
                scale="fp32",
                softcap="fp32",
                zero="fp32",
            ),
            constexprs=dict(
                HAS_CAP=cap,
                ENTROPY=ent,
                ARGMAX=arg,
                ZSUM=False,
                INTERPRET=False,
                PROMOTE=2,
                EVEN_K=True,
                BLOCK_T=64,
                BLOCK_V=128,
                BLOCK_K=128,
                GROUP_T=8,
            ),
            options=dict(num_warps=4, num_stages=3),
        )
        for cap, ent, arg in ((True, False, False), (True, True, True), (False, False, False))
    ),
    dict(
        name="softcap grad logits (cap)",
        module=("opcontract.backends.triton.softcap_logprob_kernels",) * 2,
        kernel="_grad_logits_kernel",
        signature=dict(
            h_ptr=B,
            w_ptr=B,
            t_ptr=I64,
            lse_ptr=F,
            meanz_ptr=F,
            gl_ptr=F,
            ge_ptr=F,
            gs_ptr=F,
            g_ptr=B,
            T="i32",
            V="i32",
            H="i32",
            stride_h="i32",
            stride_w="i32",
            stride_g="i32",
            v_first="i32",
            n_cols="i32",
            scale="fp32",
            softcap="fp32",
            multiplier="fp32",
            ignore_index="i32",
            zero="fp32",
        ),
        constexprs=dict(
            HAS_CAP=True,
            ENTROPY=False,
            SMOOTH=False,
            INTERPRET=False,
            PROMOTE=2,
            EVEN_K=True,
            BLOCK_T=128,
            BLOCK_V=128,
            BLOCK_K=128,
            GROUP_T=8,
        ),
        options=dict(num_warps=8, num_stages=3),
    ),
]

_DEBUG = re.compile(r"^\s*(\.file|\.loc|//|\.section\s+\.debug|\$L__|\.b8|\.b32\s+\d)")


def normalize(ptx: str) -> list[str]:
    """PTX without debug information (file names, line locations, DWARF sections)."""
    out, in_debug = [], False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            in_debug = True
        if in_debug:
            if line.strip() == "}":
                in_debug = False
            continue
        if _DEBUG.match(line):
            continue
        out.append(line.rstrip())
    return out


def compile_tree(tree: str, which: int) -> dict[str, str]:
    """PTX of every spec, compiled in a fresh process that imports opcontract from ``tree``."""
    code = f"""
import importlib, inspect, json, sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, {tree!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, {str(Path(__file__).parent)!r})
from ptx_compare import SPECS
out = {{}}
for s in SPECS:
    fn = getattr(importlib.import_module(s["module"][{which}]), s["kernel"])
    params = inspect.signature(fn.fn).parameters
    consts = dict(s["constexprs"])
    if {which} == 1:
        consts.update(s.get("new_only", {{}}))
    sig = dict(s["signature"])
    for n, p in params.items():
        if n not in sig:
            sig[n] = "constexpr"
            if n not in consts:
                consts[n] = p.default
    src = ASTSource(fn, sig, {{(fn.arg_names.index(n),): v for n, v in consts.items()}})
    opts = dict(s["options"], enable_fp_fusion=True)
    out[s["name"]] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
print(json.dumps(out))
"""
    env = {
        "PYTHONPATH": tree,
        "PATH": "/usr/bin:/bin",
        "TRITON_CACHE_DIR": f"/tmp/ptx_cache_{which}",
    }
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(f"compile in {tree} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import triton

    old, new = compile_tree(args.old, 0), compile_tree(args.new, 1)
    rows = []
    for s in SPECS:
        a, b = normalize(old[s["name"]]), normalize(new[s["name"]])
        diff = [
            d
            for d in difflib.unified_diff(a, b, lineterm="", n=0)
            if d[:1] in "+-" and not d.startswith(("+++", "---"))
        ]
        # the NaN-propagating min (min.NaN.f32) in the new tanh's clamp is the one intended
        # difference: is it the only one?
        nan_min = [line.replace("min.NaN.f32", "min.f32") for line in b] == a
        rows.append(
            {
                "spec": s["name"],
                "kernel": s["kernel"],
                "equal": not diff,
                "equal_but_min_nan": nan_min,
                "changed_lines": len(diff),
                "diff": diff[:40],
            }
        )
        how = "equal" if not diff else "only min -> min.NaN" if nan_min else "DIFFER"
        print(f"{how:20s} {s['name']}" + (f" ({len(diff)} lines)" if diff else ""))
    Path(args.out).write_text(
        json.dumps(
            {
                "benchmark": "ptx_compare",
                "command": " ".join(["python", *sys.argv]),
                "triton": triton.__version__,
                "target": "sm_90",
                "rows": rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
