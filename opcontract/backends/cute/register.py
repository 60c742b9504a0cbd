"""Registrations of the CuTe DSL backend's implementations. Importing this never imports
CUTLASS: kernels and the library load on the first call."""

from __future__ import annotations

from opcontract.backends import gemm_op
from opcontract.backends.cute import dense_gemm as dg
from opcontract.backends.cute import missing_library
from opcontract.backends.registry import register

# What every CuTe implementation shares: SM90 kernels (TMA, WGMMA, setmaxnreg), 16-bit floats.
_CUTE = dict(
    backend="cute",
    devices=("cuda",),
    capability=((9, 0), (9, 0)),
    dtypes=("bfloat16", "float16"),
    invariances=("run_to_run", "batch"),
    available=missing_library,
    # Below Triton (20) until the kernel has passed the conformance kit on an SM90 GPU: it
    # compiles to sm_90a but has not run yet, so it serves only calls that ask for "cute".
    priority={"cuda": 10},
)

register(
    op="dense_gemm",
    name="cute.gemm",
    run=lambda config, **kw: gemm_op.dense_gemm("cute", **kw, config=config),
    config_space=dg.CONFIG_SPACE,
    default_config=lambda call: dg.default_config(),
    **gemm_op.strict_declaration(),
    summary=(
        "warp-specialised TMA + WGMMA GEMM (SM90), K in 256-element float32 partials promoted "
        "in registers, no split-K, bias in float32; backward by the same kernel"
    ),
    **_CUTE,
)
