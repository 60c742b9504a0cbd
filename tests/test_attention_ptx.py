"""The Triton gated_attention forward compiled for sm_90 on any machine (Triton compiles for
the target it is told; no GPU needed): the instruction shape its bits rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# compiled in a fresh process: with TRITON_INTERPRET=1 (the suite's default on the CPU) the
# kernels are interpreter functions, which don't compile
_CHILD = r"""
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from opcontract.backends.triton import gated_attention_kernels as kk

P, F, I = "*bf16", "*fp32", "*i32"
SIG = dict(q_ptr=P, k_ptr=P, v_ptr=P, gate_ptr=P, positions_ptr=I, block_rows_ptr=I,
           key_len_ptr=I, tile_ptr=I, out_ptr=P, attn_ptr=F, lse_ptr=F, go_ptr=I, redo_ptr=I,
           T="i32", N="i32", Hq="i32", Hkv="i32", G="i32", D="i32", NB="i32", window="i32",
           c="fp32")
fn = kk._attn_fwd_kernel
out = {}
for interior in (False, True):
    consts = dict(LOCAL=False, INTERPRET=False, IEEE=False, SAFE=False, BLOCK_M=128,
                  BLOCK=128, BLOCK_D=128, CHUNK_BLOCKS=4, INTERIOR=interior, FLAT=False)
    sig = dict(SIG)
    for name, p in inspect.signature(fn.fn).parameters.items():
        if name not in sig:
            sig[name] = "constexpr"
            consts.setdefault(name, p.default)
    hinted = [n for n, t in sig.items() if t.startswith("*") or n in ("Hq", "G", "D", "window")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    src = ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=8, num_stages=2)).asm["ptx"]
    out[str(interior)] = {op: len(re.findall(pat, ptx)) for op, pat in
                          (("ex2", r"\bex2\.approx"), ("sub", r"\bsub\.f32"),
                           ("fma", r"\bfma\.rn\.f32"))}
print(json.dumps(out))
"""


def test_interior_blocks_round_the_score_before_subtracting_the_max(tmp_path):
    """Every exp2 the interior path adds takes a plain subtraction, as the masked path's do:
    the score ``qk * c`` is rounded before ``s - m``. On the H200 a bare product next to the
    subtraction was contracted into one fma (one rounding, not two) and the interior path's
    outputs differed from the masked path's (attention_forward_options_h200.json); the
    select in ``_block_update`` keeps them apart."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        if "GPUTarget" in run.stderr or "ptxas" in run.stderr.lower():
            pytest.skip(f"cannot compile for sm_90 here: {run.stderr[-300:]}")
        raise AssertionError(run.stderr[-3000:])
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    plain, interior = counts["False"], counts["True"]
    more = {op: interior[op] - plain[op] for op in plain}
    assert more["ex2"] > 0, counts  # the interior loop is there
    assert more["sub"] == more["ex2"], counts
    assert more["fma"] < more["ex2"], counts
