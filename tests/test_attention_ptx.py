"""The Triton gated_attention forward compiled for sm_90 on any machine (Triton compiles for
the target it is told; no GPU needed): the instruction shape its bits rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
# compiled in a fresh process: with TRITON_INTERPRET=1 (the suite's default on the CPU) the
# kernels are interpreter functions, which don't compile
_CHILD = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
from sm90_compile import compile_attention
out = {}
for interior in (False, True):
    consts = dict(SAFE=False, BLOCK_M=128, INTERIOR=interior, FLAT=False)
    ptx = compile_attention("_attn_fwd_kernel", consts, 8, 2)[0].asm["ptx"]
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
    cmd = [sys.executable, "-c", _CHILD, str(BENCHMARKS)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
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
