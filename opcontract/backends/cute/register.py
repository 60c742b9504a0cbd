"""Registrations of the CuTe DSL backend's implementations. Importing this never imports
CUTLASS: kernels and the library load on the first call."""

from __future__ import annotations

from opcontract.backends.cute import dense_gemm as dg
from opcontract.backends.cute import missing_library
from opcontract.backends.dense_gemm import strict_declaration
from opcontract.backends.registry import register

# What every CuTe implementation shares: SM90 kernels (TMA, WGMMA, setmaxnreg), 16-bit floats.
_CUTE = dict(
    backend="cute",
    devices=("cuda",),
    capability=((9, 0), (9, 0)),
    dtypes=("bfloat16", "float16"),
    invariances=("run_to_run", "batch"),
    available=missing_library,
    # Above Triton (20): on the H200 it passed the conformance kit (bf16, fp16, forward and
    # gradients), its rows are bitwise equal to triton.gemm's on the four Muse Glimmer shapes
    # at every M tried, forward and backward, and it is faster from M = 256 up
    # (benchmarks/results/cute_gemm_h200.json). Where a tuning table times both, the faster
    # one per bucket serves; their equal bits keep that batch-invariant.
    priority={"cuda": 30},
)

register(
    op="dense_gemm",
    name="cute.gemm",
    forward=dg.gemm_forward,
    backward=dg.gemm_backward,
    layout={"*": "any"},  # copies into TMA-ready buffers itself where it must
    config_space=dg.CONFIG_SPACE,
    default_config=lambda call: dg.default_config(),
    **strict_declaration(),
    summary=(
        "warp-specialised TMA + WGMMA GEMM (SM90), K in 256-element float32 partials promoted "
        "in registers, no split-K, bias in float32; backward by the same kernel"
    ),
    **_CUTE,
)
